"""LangChain store: the unmodified langchain-tests standard suite (sync and async) in embedded mode,
then what the suite does not cover: filters, scores and relevance per metric, MMR, from_texts,
as_retriever, bad input."""

from collections.abc import Iterator

import numpy as np
import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings
from langchain_tests.integration_tests.vectorstores import VectorStoreIntegrationTests

from fusionrag.integrations.langchain import FusionRAGVectorStore
from fusionrag.retriever.errors import ConfigError, InputError
from integration_helpers import API_KEY, running_service


class TestEmbeddedStandard(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, tmp_path) -> Iterator[FusionRAGVectorStore]:
        store = FusionRAGVectorStore(embedding=self.get_embeddings(), path=tmp_path, collection="lc")
        try:
            yield store
        finally:
            store.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[str]:
    with running_service(tmp_path_factory.mktemp("service")) as url:
        yield url


class TestRemoteStandard(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, service, request) -> Iterator[FusionRAGVectorStore]:
        # A collection per test, dropped after it: the suite wants an empty store each time.
        name = f"lc-{request.node.name.replace('_', '-')}"[:64]
        store = FusionRAGVectorStore(embedding=self.get_embeddings(), url=service, api_key=API_KEY, collection=name)
        try:
            yield store
        finally:
            store.delete()
            store.close()
