"""Load tests with Locust: retrieval alone, and retrieval alongside LLM inference."""
