"""Interoperability with other ecosystems (Hugging Face Transformers)."""
