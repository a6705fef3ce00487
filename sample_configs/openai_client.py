"""Talk to a server started through expert-stream with the OpenAI client (pip install openai).

    expert-stream serve --config sample_configs/mlx-openai-server.yaml
    python sample_configs/openai_client.py --model qwen3-235b
"""

import argparse
import json
import urllib.request

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://127.0.0.1:8000")
parser.add_argument("--model", default="qwen3-235b")
parser.add_argument("--prompt", default="Why do mixture-of-experts models fit on small machines?")
args = parser.parse_args()

client = OpenAI(base_url=args.base_url + "/v1", api_key="not-needed")
stream = client.chat.completions.create(
    model=args.model, messages=[{"role": "user", "content": args.prompt}], max_tokens=200, stream=True
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()

# The plugin's status endpoint (loopback only): per-model state and expert cache counters.
with urllib.request.urlopen(args.base_url + "/expert-stream/status") as response:
    status = json.load(response)
for model_id, model in status["models"].items():
    totals = (model.get("stats") or {}).get("totals") or {}
    print(model_id, model["state"], f"hit rate {totals['hit_rate']:.1%}" if totals else "(stock)")
