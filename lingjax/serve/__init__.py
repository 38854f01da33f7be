"""`lingjax serve`: an OpenAI-compatible local server at batch 1 (docs/serve.md).

protocol: the API's requests checked, and its error body; backend: the model behind the server and the one worker
thread generations run in; reasoning: Ling-3's thinking and tool calls split from the reply as it streams; app: the
FastAPI app; command: the CLI subcommand. Only app and command's serve() import FastAPI and uvicorn (the `serve`
extra), so the rest of lingjax starts without them.
"""
