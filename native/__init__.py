"""Optional native reader (native/reader.c, built as `expert_stream.native._reader`).

`available` says whether the extension imported; `import_error` says why not. The Python path
in `expert_stream.streaming.reader` gives the same bytes when it is missing.
"""

try:
    from . import _reader
except ImportError as exc:  # no compiler at install time, or a stale build
    _reader = None
    available = False
    import_error = str(exc)
else:
    available = True
    import_error = None

__all__ = ["available", "import_error", "_reader"]
