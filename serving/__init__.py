"""Serving: a trained model behind OpenAI's API, with many requests decoded together.

Usage:
    python serve.py --run runs/chat_sft                 # the command; see serve.py
    from serving.engine import Engine                   # continuous batching
    from serving.app import Service, create_app         # the HTTP routes and the chat page

engine.py batches requests, reuses cached prefixes and prefills in chunks (it knows no
HTTP). api.py holds OpenAI's request and response shapes (it knows no model). answer.py
turns a request's events into its answer, whole or streamed. app.py joins them with the
routes and the error handling, limits.py caps request bodies, and chat.html is the page.
"""
