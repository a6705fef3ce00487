"""The English text the synthetic tokenizer is trained on. Written for this project and kept in
the source (no download), so every machine trains the same merges and a checkpoint's
tokenizer.json is identical everywhere. If the text yields fewer merges than a large requested
vocabulary needs, the tokenizer fills the rest with reserved special tokens."""

CORPUS = """\
The morning train left the station a few minutes late, and the passengers settled into their
seats with coffee, newspapers and the quiet patience of people who make the same trip every day.
Outside the window the fields were still grey with frost. A farmer was walking along a fence,
counting the posts that the winter storms had knocked over, and a dog ran ahead of him.

A small bakery on the corner opens at six. The baker arrives at four, lights the ovens, and mixes
flour, water, salt and yeast in a large bowl. While the dough rises she prepares the fillings:
apples with cinnamon, cheese with spinach, and a dark chocolate cream that children ask for by
name. By seven there is a line outside the door, and by noon most of the shelves are empty.

Computers store every number as a pattern of bits. A byte holds eight bits, so it can represent
two hundred and fifty six different values. Larger numbers need several bytes, and the order in
which those bytes are written matters when one machine reads a file that another machine wrote.
Programs that move data between systems must agree on the order, the size and the meaning of
every field, or the numbers that arrive will look like nonsense.

Memory is fast but limited; disks are slow but large. When a program needs more data than fits
in memory, it keeps the most useful part close at hand and reads the rest only when it must.
Choosing what to keep is the hard part. A good cache remembers what was used recently, guesses
what will be needed next, and never throws away something that is still being used.

The river begins as a spring high in the mountains. It gathers water from melting snow and from
hundreds of small streams, grows wider in the valley, and turns slowly through towns, farms and
forests before it reaches the sea. In spring the water is cold and brown; in late summer it is
clear and warm enough for swimming, and families spend long afternoons on its sandy banks.

Learning a language takes time. At first every sentence is a puzzle: which word is the subject,
which is the verb, why does this ending change? After a few months the patterns become familiar,
and one day you notice that you understood a whole conversation without translating it in your
head. That moment is worth the effort of all the evenings spent with a dictionary and a notebook.

A good recipe for soup: chop two onions, three carrots and a stalk of celery. Warm some olive oil
in a heavy pot, add the vegetables and cook them gently for ten minutes. Pour in a litre of stock,
add a handful of lentils, a bay leaf, pepper and a little salt. Let it simmer for half an hour,
then taste it, adjust the seasoning, and serve it with fresh bread.

The meeting started at ten. The team reviewed the results of the last experiment, which had
taken three weeks to run. Two of the measurements disagreed with the model, and nobody could
explain why. Someone suggested that the sensor had been calibrated incorrectly; someone else
thought the model itself was wrong. They agreed to repeat the test with a second sensor before
drawing any conclusions, and to write down every assumption they had made.

In the evening the city changes. Offices empty, restaurants fill, and the streets are crowded
with people walking home, meeting friends or looking for something to eat. Musicians play near
the fountain in the square. The air smells of roasted nuts and rain. Somewhere a bell rings nine
times, and the last buses leave the central station for the suburbs.

Questions and answers: What is the capital of France? Paris. How many days are in a week? Seven.
Which planet is closest to the sun? Mercury. What do bees make? Honey. Why is the sky blue?
Because air scatters blue light more than red light. Who wrote the letter? We do not know yet.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

Numbers and dates: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32, 64, 100, 128, 256, 512, 1024,
2048, 4096. The report was due on March 14, 2025, at 09:30, and it had 37 pages, 12 tables and
4 figures. The budget grew from 1.5 million to 2.25 million over three years.

Every good story has a beginning, a middle and an end. The hero wants something, meets an
obstacle, tries and fails, learns something about herself, and tries again. Readers keep turning
the pages because they want to know whether she will succeed, and because they recognise their
own hopes and fears in hers. The best endings feel surprising and inevitable at the same time.

Birds were singing in the hedges when we reached the top of the hill. Below us the valley was
covered in mist, and only the church tower and the tallest trees rose above it. We sat on a flat
rock, ate our sandwiches and watched the mist slowly lift as the sun climbed higher. By the time
we started down, the whole valley was bright and green, and we could hear cows in the meadows.

Good software is written for people first and for machines second. Names should say what a
thing is; functions should do one thing; errors should say what went wrong and what to do next.
Tests should be small, fast and honest: a test that cannot fail proves nothing. When something
breaks, read the message carefully, reproduce the problem, and change one thing at a time.

The library was quiet except for the soft turning of pages and the occasional cough. Students
bent over their books at long wooden tables, and an old man in the corner read a newspaper from
the first page to the last, folding it neatly when he had finished. The librarian stamped the
returned books, placed them on a trolley and wheeled it between the tall shelves.

Weather report: tomorrow will be cloudy in the north with light rain in the afternoon. The south
will stay dry and sunny, with temperatures between eighteen and twenty four degrees. Winds will
be moderate, strengthening near the coast in the evening. Over the weekend a colder front will
bring showers, thunder and much lower temperatures to most of the country.

She opened the old box carefully. Inside were letters tied with a red ribbon, a silver watch that
had stopped at twenty past three, a photograph of a young man in uniform, and a small key that did
not fit any lock in the house. She spent the whole afternoon reading the letters, and by evening
she knew where the key belonged.
"""
