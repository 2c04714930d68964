"""ctypes mirrors of the C structs in decode_step.c (field order and types must match)."""

from __future__ import annotations

import ctypes

# Matrix kinds; the _A8 ones take int8 activations (linear_a8.h), and the _A8_TILES ones are
# the same products with a tile of outputs interleaved per vector (ss_a8_tiles(): 16 outputs
# on VNNI-512 builds, 8 on AVX2 ones, which tile Q4_1 only: ss_a8_q8_tiles()).
F32, Q4_1, Q8_0, Q4_1_A8, Q8_0_A8, Q4_1_A8_TILES, Q8_0_A8_TILES = 0, 1, 2, 3, 4, 5, 6
GROUP = 32  # elements per quantized block


class Linear(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("out_features", ctypes.c_int32),
        ("in_features", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", Linear),
        ("o_proj", Linear),
        ("gate_up", Linear),
        ("down", Linear),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("vocab", ctypes.c_int32),
        ("max_pos", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("rope_cos", ctypes.c_void_p),
        ("rope_sin", ctypes.c_void_p),
        ("layers", ctypes.POINTER(Layer)),
        ("head", Linear),
        ("embed_quants", ctypes.c_void_p),
        ("embed_scales", ctypes.c_void_p),
        ("input_proj", Linear),  # a draft head's (ss_forward_head); zero for a target
    ]


class KV(ctypes.Structure):
    _fields_ = [
        ("cache", ctypes.c_void_p),
        ("block_size", ctypes.c_int32),
        ("max_blocks", ctypes.c_int32),
        ("block_tables", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


# KV element types the step reads and writes (ss_kv.dtype).
KV_F32, KV_F16 = 0, 1


def _rows_call(*row_inputs: type) -> list[type]:
    """A step's arguments: model, kv, rows, the rows' inputs, positions, tree_base,
    tree_slots, tree_width, out, threads."""
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    head = [ctypes.POINTER(Model), ctypes.POINTER(KV), integer, *row_inputs]
    return head + [pointer, pointer, pointer, integer, pointer, integer]


def declare(lib: ctypes.CDLL) -> None:
    lib.ss_forward.argtypes = [
        ctypes.POINTER(Model),
        ctypes.POINTER(KV),
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.ss_forward.restype = ctypes.c_int
    lib.ss_forward_tree.argtypes = _rows_call(ctypes.c_void_p)  # tokens
    lib.ss_forward_tree.restype = ctypes.c_int
    # tokens, and fp32 [rows, hidden] features
    lib.ss_forward_head.argtypes = _rows_call(ctypes.c_void_p, ctypes.c_void_p)
    lib.ss_forward_head.restype = ctypes.c_int
    for name in ("ss_linear_forward", "ss_linear_forward_streamed"):
        fn = getattr(lib, name)
        fn.argtypes = [
            ctypes.POINTER(Linear),
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        fn.restype = ctypes.c_int
    for name in ("ss_store_half", "ss_load_half"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    lib.ss_greedy_pick.argtypes = [
        ctypes.POINTER(Linear),  # the exact head (Q8_0)
        ctypes.c_void_p,  # approximate logits, fp32 [rows, vocab]
        ctypes.c_void_p,  # the rows' inputs, fp32 [rows, hidden]
        ctypes.c_int,
        ctypes.c_void_p,  # the bound's weight side, fp32 [vocab, blocks]
        ctypes.c_void_p,  # its largest per block, fp32 [blocks]
        ctypes.c_float,
        ctypes.c_void_p,  # out: int64 [rows]
    ]
    lib.ss_greedy_pick.restype = ctypes.c_int
    lib.ss_simd.argtypes = []
    lib.ss_simd.restype = ctypes.c_int
    for name in ("ss_a8_tiles", "ss_a8_q8_tiles"):
        fn = getattr(lib, name)
        fn.argtypes = []
        fn.restype = ctypes.c_int
