"""vLLM glue: the endpoint plugin (plugin.py, imported by vLLM), batch RAG with the offline engine
(offline.py), the RAG prompt (prompt.py) and the GPU memory split (memory.py)."""

from fusionrag.integrations.vllm.memory import GPUSplit, plan_gpu_split, plan_plugin_split
from fusionrag.integrations.vllm.offline import RAGAnswer, rag_chat
from fusionrag.integrations.vllm.prompt import PASSAGE_TEMPLATE, RAG_TEMPLATE, augment

__all__ = ["GPUSplit", "PASSAGE_TEMPLATE", "RAG_TEMPLATE", "RAGAnswer", "augment", "plan_gpu_split",
           "plan_plugin_split", "rag_chat"]
