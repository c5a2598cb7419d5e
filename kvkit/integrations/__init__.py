"""Adapters that plug kvkit into inference engines (vLLM, Hugging Face).

Each submodule imports its engine; ``import kvkit`` imports none of them.
"""
