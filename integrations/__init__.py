"""LangChain and LlamaIndex vector stores over fusionrag collections, and vLLM glue."""
