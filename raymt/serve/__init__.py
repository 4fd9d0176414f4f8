"""`raymt serve`: online translation on Ray Serve, batched across requests by source tokens.

- `text`: a request's text into sentences (lines kept, over-long sentences chunked) and back
- `batcher`: one replica's queue and the loop that decodes token-budget batches across requests
- `api`: one model's HTTP API (native /v1/translate, LibreTranslate's /translate), a replica's health
- `routing`: which model answers (by name or pair), /languages and /v1/models, JSON errors
- `page`: the one-page UI at /
- `app`: the Serve replica and deployment; `__main__`: the command (docs/serving.md)
"""
