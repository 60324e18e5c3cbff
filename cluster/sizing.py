"""Does one engine replica fit a node, and can it load in time? Checked by `build_app` against the
Ray nodes it sees and by the tests against the pods of every deploy/k8s profile.

A replica is one placement group, STRICT_PACKed onto one node (its ranks rendezvous over
loopback, so tensor parallelism never spans nodes):

    bundle 0: {CPU: 1}            the replica (scheduler, detokenizer), no device
    bundle r: {CPU: 1, GPU: 1}    rank r-1, for r in 1..tp   (tp = 1: the replica is the rank)

    per GPU:  weight shard + activations + KV for one max_model_len sequence
              <= gpu_memory_utilization x GPU memory (the engine keeps 5% of it for activations)
    per node: the processes (replica + ranks) + on CPU the weights and the KV cache
              <= the node's memory (a pod's memory limit, Ray's `memory` resource)
    load:     checkpoint bytes / read rate <= load_timeout_s (rank 0 reads the whole checkpoint)

Byte counts are estimates from the model's shapes, meant to catch a profile that cannot work (a
70B shard on a 40 GB GPU, TP8 on an 8-CPU pod), not to predict the KV cache to the block.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import EngineConfig
from engine.model.llama import ModelArch

# The stated rate at which rank 0 reads the checkpoint: 125 MiB/s is the baseline throughput of
# the common default cloud volumes (AWS gp3, GCP pd-balanced at small sizes); NFS-class shared
# volumes often do less. Override with the app argument weights_read_bytes_per_s.
DEFAULT_READ_BYTES_PER_S = 125 * 2**20
CPU_PROCESS_BYTES = 1 << 30  # a Ray worker process with torch and transformers imported
GPU_PROCESS_BYTES = 5 << 29  # the same with a CUDA context and its libraries (host memory)
GPU_ACTIVATION_HEADROOM = 0.05  # engine.kv_cache.num_kv_blocks leaves this fraction for activations
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class SizingError(ValueError):
    """The replica cannot fit any node it may run on, or cannot load within its timeout."""


@dataclass(frozen=True)
class NodeShape:
    name: str
    cpus: float
    gpus: float
    memory: int | None = None  # bytes: a pod's memory limit, Ray's `memory` resource
    gpu_memory: int | None = None  # bytes per GPU, where known


@dataclass(frozen=True)
class ReplicaNeeds:
    tp: int
    cpus: float  # on one node: bundle 0 + one per rank
    gpus: int  # on one node
    host_memory: int  # bytes on that node
    gpu_weights: int  # bytes per GPU: the weight shard (0 on CPU)
    gpu_activations: int  # bytes per GPU: one step's activations and logits (0 on CPU)
    gpu_kv_min: int  # bytes per GPU: KV for one max_model_len sequence (0 on CPU)
    checkpoint_bytes: int
    gpu_memory_utilization: float = 0.9

    def load_s(self, read_bytes_per_s: float) -> float:
        return self.checkpoint_bytes / read_bytes_per_s


def param_count(a: ModelArch, pooling: bool = False) -> int:
    """The parameters a replica holds: a pooling one (engine.pooling) has no language-model head,
    only the embedding table and a classifier's small head, where it has one."""
    if a.encoder:
        return _encoder_param_count(a)
    h, hd = a.hidden_size, a.head_dim
    biases = (a.num_heads + 2 * a.num_kv_heads) * hd if a.attention_bias else 0
    biases += 2 * a.intermediate_size + h if a.mlp_bias else 0
    embeddings = a.vocab_size * h * (1 if a.tie_word_embeddings or pooling else 2) + a.num_labels * h
    return embeddings + a.num_layers * (linear_params(a) + biases + 2 * h) + h


def linear_params(a: ModelArch) -> int:
    """A decoder layer's linear weights: q, k, v and o; gate, up and down."""
    h, hd = a.hidden_size, a.head_dim
    return h * a.num_heads * hd * 2 + h * a.num_kv_heads * hd * 2 + 3 * h * a.intermediate_size


def _encoder_param_count(a: ModelArch) -> int:
    """engine.model.bert's and engine.model.modernbert's: q, k, v and o; up (and a gate) and down;
    two LayerNorms a layer; biases where the config sets them."""
    h, inter = a.hidden_size, a.intermediate_size
    attn = 4 * h * h + (4 * h if a.attention_bias else 0)
    gated = a.gated_mlp or a.modernbert
    up_bias = a.mlp_bias if a.up_bias is None else a.up_bias
    up_biases = (2 * inter if gated else inter) if up_bias else 0
    mlp = (3 if gated else 2) * h * inter + up_biases + (h if a.mlp_bias else 0)
    norm = h * (2 if a.norm_bias else 1)
    if a.modernbert:  # pre-norm: the first layer has none before attention, and a final norm follows;
        # no position or token-type tables; a classifier's head: dense, norm, classifier
        head = h * h + (h if a.classifier_bias else 0) + norm + a.num_labels * (h + 1) if a.num_labels else 0
        return a.vocab_size * h + 2 * norm + a.num_layers * (attn + mlp + 2 * norm) - norm + head
    # a position table (none with rotary positions) and token types; a classifier's dense + out
    # head (a token classifier's: the out head alone)
    tables = (a.vocab_size + (0 if a.rotary else a.position_rows) + a.type_vocab_size) * h
    head = (0 if a.token_classifier else h * h + h) + a.num_labels * (h + 1) if a.num_labels else 0
    return tables + norm + a.num_layers * (attn + mlp + 2 * norm) + head


def largest_tensor(a: ModelArch) -> int:
    """Elements of the largest checkpoint tensor (what rank 0 holds in host memory while scattering)."""
    return max(a.vocab_size * a.hidden_size, a.hidden_size * a.intermediate_size)


def checkpoint_bytes(model_dir: str | Path | None, arch: ModelArch, dtype_bytes: int = 2) -> int:
    """The safetensors files' size where the directory holds them, else params x dtype_bytes."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir else []
    return sum(f.stat().st_size for f in files) if files else param_count(arch) * dtype_bytes


def checkpoint_dtype(model_dir: str | Path | None) -> str:
    """The dtype config.json names (torch_dtype, or transformers' newer `dtype`), a DTYPE_BYTES
    key; bfloat16 where it names none of them."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, TypeError, ValueError):
        return "bfloat16"
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16") if isinstance(cfg, dict) else ""
    return name if name in DTYPE_BYTES else "bfloat16"


def cpu_weight_bytes(arch: ModelArch, nbytes: int, ckpt_bytes: int, pooling: bool = False,
                     ckpt_dtype: str = "bfloat16") -> int:
    """The weights' forms a CPU replica holds (engine.model.loader.prepare_cpu_weights). Float32
    serving keeps a oneDNN-prepacked copy of each linear weight for prefill. For a bfloat16
    checkpoint (~2 bytes a parameter on disk) it also keeps each one's bfloat16 half for decode
    (engine.model.codes), and then drops its plain float32, the embedding table's too (its lookup
    reads the halves). A float16 checkpoint's weights are no bfloat16 halves: float32 is kept, as
    for a float32 one (`ckpt_dtype`: config.json's, checkpoint_dtype). A pooling replica's table is
    a lookup table only, tied or not."""
    params = param_count(arch, pooling)
    if nbytes != 4 or arch.encoder:  # an encoder's weights are held once, as loaded
        return params * nbytes
    tied_head = arch.tie_word_embeddings and not pooling  # the table is the head too: prepacked, like a linear layer
    lookup_only = 0 if tied_head else arch.vocab_size * arch.hidden_size
    if arch.quantization is not None:  # GPTQ/AWQ: the layers' weights prepacked, and as codes or float32
        layers = arch.num_layers * linear_params(arch)
        code_bytes = arch.quantization.code_bytes
        rest = params - layers - lookup_only  # the head, the norms and a classifier's head, from float16 or
        return layers * (4 + (code_bytes or 4)) + lookup_only * 4 + rest * 8  # bfloat16: counted as float16
    if ckpt_bytes >= 3 * params or ckpt_dtype != "bfloat16":  # each weight, and a linear one's prepacked copy
        return lookup_only * 4 + (params - lookup_only) * (4 + 4)
    return lookup_only * 2 + (params - lookup_only) * (4 + 2)  # bfloat16: the halves, and the prepacked copy


def replica_needs(engine: EngineConfig, arch: ModelArch, ckpt_bytes: int, use_gpu: bool,
                  pooling: bool = False, ckpt_dtype: str = "bfloat16") -> ReplicaNeeds:
    """`pooling`: the replica pools (engine.pooling): no language-model head, no vocabulary logits.
    `ckpt_dtype`: the checkpoint's (checkpoint_dtype)."""
    tp = engine.tensor_parallel_size
    dtype = engine.dtype if engine.dtype != "auto" else ("bfloat16" if use_gpu else "float32")
    nbytes = DTYPE_BYTES[dtype]
    params = param_count(arch, pooling)
    shard = params * nbytes // tp
    kv_heads = arch.local_kv_heads(tp)
    kv_per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * nbytes  # one rank's K and V
    max_len = engine.model_len(arch.max_position_embeddings)
    tokens = max(engine.max_num_batched_tokens, max_len) if arch.encoder else engine.max_num_batched_tokens
    per_token = 4 * arch.hidden_size + (2 * arch.intermediate_size + (arch.num_heads + 2 * kv_heads) * arch.head_dim) // tp
    outputs = arch.hidden_size if pooling else arch.vocab_size  # per sampled row, in float32: a vector or logits
    activations = tokens * per_token * nbytes + min(engine.max_num_seqs, tokens) * outputs * 4
    processes = 1 + (tp if tp > 1 else 0)
    if use_gpu:
        host = processes * GPU_PROCESS_BYTES + 2 * largest_tensor(arch) * nbytes  # rank 0: a tensor and its pieces
        return ReplicaNeeds(tp, cpus=processes, gpus=tp, host_memory=host, gpu_weights=shard,
                            gpu_activations=activations, gpu_kv_min=0 if arch.encoder else kv_per_token * max_len,
                            checkpoint_bytes=ckpt_bytes, gpu_memory_utilization=engine.gpu_memory_utilization)
    # An explicit KV size is per rank; the default one is a share of whatever RAM is left, so it fits.
    kv = engine.kv_cache_memory * tp if engine.kv_cache_memory is not None else 0
    weights = cpu_weight_bytes(arch, nbytes, ckpt_bytes, pooling, ckpt_dtype)
    host = processes * CPU_PROCESS_BYTES + weights + kv + activations
    return ReplicaNeeds(tp, cpus=processes, gpus=0, host_memory=host, gpu_weights=0, gpu_activations=0,
                        gpu_kv_min=0, checkpoint_bytes=ckpt_bytes)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def node_problems(needs: ReplicaNeeds, node: NodeShape) -> list[str]:
    """Why one replica cannot run on this node ([] if it can)."""
    out = []
    if node.cpus < needs.cpus:
        out.append(f"{needs.cpus:g} CPUs (1 for the replica + 1 per rank) but {node.name} has {node.cpus:g}")
    if node.gpus < needs.gpus:
        out.append(f"{needs.gpus} GPUs on one node but {node.name} has {node.gpus:g} (a replica's ranks must share "
                   "a node: multi-node tensor parallelism is not supported)")
    if node.memory is not None and node.memory < needs.host_memory:
        out.append(f"~{_gib(needs.host_memory)} of memory but {node.name} has {_gib(node.memory)}")
    if needs.gpus and node.gpu_memory:
        usable = node.gpu_memory * (needs.gpu_memory_utilization - GPU_ACTIVATION_HEADROOM)
        if needs.gpu_weights + needs.gpu_kv_min > usable:
            out.append(f"{_gib(needs.gpu_weights)} of weights + {_gib(needs.gpu_kv_min)} of KV for one max_model_len "
                       f"sequence per GPU but {node.name}'s GPUs give the engine {_gib(usable)}")
        if needs.gpu_activations > node.gpu_memory * (1 - needs.gpu_memory_utilization + GPU_ACTIVATION_HEADROOM):
            out.append(f"~{_gib(needs.gpu_activations)} of activations per GPU, more than gpu_memory_utilization "
                       f"leaves on {node.name}'s GPUs")
    return out


def load_problems(needs: ReplicaNeeds, load_timeout_s: float, read_bytes_per_s: float) -> list[str]:
    if needs.tp == 1:  # the replica loads in-process; no worker-group timeout applies
        return []
    load_s = needs.load_s(read_bytes_per_s)
    if load_s <= load_timeout_s:
        return []
    return [f"reading the {needs.checkpoint_bytes / 1e9:.1f} GB checkpoint at {read_bytes_per_s / 2**20:.0f} MiB/s "
            f"takes ~{load_s:.0f} s, more than load_timeout_s={load_timeout_s:g} (raise load_timeout_s, or state a "
            f"faster volume with weights_read_bytes_per_s)"]


def check(needs: ReplicaNeeds, nodes: list[NodeShape], load_timeout_s: float,
          read_bytes_per_s: float = DEFAULT_READ_BYTES_PER_S) -> NodeShape | None:
    """-> a node that holds one replica (None when `nodes` is empty: nothing to check against).
    Raises SizingError naming every problem otherwise."""
    problems = load_problems(needs, load_timeout_s, read_bytes_per_s)
    fitting = [n for n in nodes if not node_problems(needs, n)]
    if nodes and not fitting:
        best = max(nodes, key=lambda n: (n.gpus, n.cpus, n.memory or 0))
        problems += [f"a replica (tensor_parallel_size={needs.tp}) needs {p}" for p in node_problems(needs, best)]
    if problems:
        raise SizingError("; ".join(problems))
    return fitting[0] if fitting else None


def ray_nodes(device_gpu: bool) -> list[NodeShape]:
    """The alive Ray nodes that could host a replica's device: GPU nodes for a GPU replica, nodes
    with CPUs otherwise (a KubeRay head started with num-cpus 0 is never one)."""
    import ray

    out = []
    for n in ray.nodes():
        res = n.get("Resources", {})
        if not n.get("Alive") or res.get("CPU", 0) <= 0 or (device_gpu and res.get("GPU", 0) <= 0):
            continue
        out.append(NodeShape(f"node {n.get('NodeManagerAddress', '?')}", res.get("CPU", 0), res.get("GPU", 0),
                             int(res["memory"]) if "memory" in res else None))
    return out


def replicas_per_node(needs: ReplicaNeeds, node: NodeShape) -> int:
    """How many replicas side by side fit this node (0: none)."""
    if node_problems(needs, node):
        return 0
    fits = [int(node.cpus // needs.cpus)]
    if needs.gpus:
        fits.append(int(node.gpus // needs.gpus))
    if node.memory is not None and needs.host_memory:
        fits.append(int(node.memory // needs.host_memory))
    return min(fits)
