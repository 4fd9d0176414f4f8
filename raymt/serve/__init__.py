"""`raymt serve`: online translation on Ray Serve, batched across requests by source tokens.

- `text`: a request's text into sentences (lines kept, over-long sentences chunked) and back
- `batcher`: one replica's queue and the loop that decodes token-budget batches across requests
- `api`: the HTTP API (native /v1/translate, LibreTranslate's /translate and /languages, health)
- `page`: the one-page UI at /
- `app`: the Serve replica and deployment; `__main__`: the command (docs/serving.md)
"""
