"""Serving: a trained model behind OpenAI's API, many requests decoded together.

Usage:
    python serve.py --run runs/chat_sft                 # the command; see serve.py
    from serving.engine import Engine                   # continuous batching
    from serving.app import Service, create_app         # the HTTP routes and the chat page

engine.py batches, reuses cached prefixes and prefills in chunks (no HTTP), api.py holds
OpenAI's shapes (no model), answer.py turns a request's events into its answer, whole or
streamed, app.py joins them (routes, errors), limits.py caps request bodies, chat.html is
the page.
"""
