"""The HTTP API by endpoint family: `chat` (/v1/chat/completions), `completions`
(/v1/completions), `native` (SGLang's /generate), `admin` (health, metrics, models, server info,
cache flush). `common` holds what they share: errors, body reading, auth, request plumbing."""
