"""Data: text inputs (text), the prepared-corpus format (format), its writer (prepare) and
per-worker reader (stream), named downloads (download) and the generated built-in corpus
(builtin). `python -m raymt.data prepare ...` is the command line (__main__)."""
