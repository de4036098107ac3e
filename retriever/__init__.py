"""retriever"""
