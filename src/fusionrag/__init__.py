"""fusionrag: RAG retrieval over a FusionANNS-style index (host RAM, GPU memory, SSD)."""

__version__ = "0.1.0"
