"""The serving side: CLI arguments, the process tree, and the OpenAI-compatible HTTP API.

Importing this package is cheap (no FastAPI, no torch); `api_server` pulls in the web stack.
"""
