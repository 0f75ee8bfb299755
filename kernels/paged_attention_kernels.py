"""The Triton kernels of paged attention (decode, its merge, prefill); wrappers in `paged_attention`."""

import triton
import triton.language as tl

from lowvram.kernels.paged_kv_tiles import (
    _CODES_ONLY,
    _KEPT_ONLY,
    _MIXED,
    _block_tokens,
    _code_mask,
    _kept_mask,
    _load_kv,
    _load_query_planes,
    _store_planes,
    _table_blocks,
    _tile_scales,
    _tokens,
)

WINDOW_TILE_TOKENS = tl.constexpr(64)


@triton.jit
def _softmax_step(scores, m_i, l_i, TOKEN_AXIS: tl.constexpr):
    # Online softmax over a tile of base-2 scores (tokens along TOKEN_AXIS): (new max, rescale of
    # the old sums, weights p, new sums). A row that has seen no token keeps m = -inf, adds 0.
    m_new = tl.maximum(m_i, tl.max(scores, axis=TOKEN_AXIS))
    m_seen = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_seen)
    p = tl.exp2(scores - tl.expand_dims(m_seen, TOKEN_AXIS))
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=TOKEN_AXIS)


@triton.jit
def _attend_tile(query, state, is_visible, cache, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW):
    # Prefill: query = (rows q as planes [R, BLOCK_C], q_sum [R] their sums, scale_log2) over one
    # K/V tile where is_visible [R, BLOCK_N]: the new state (m_i, l_i, acc).
    q, q_sum, scale_log2 = query
    NUM_PLANES: tl.constexpr = 16 // BITS
    m_i, l_i, acc = state
    k_tile, v_tile = _load_kv(
        cache, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, q[0].dtype, _MIXED, False, False
    )
    k, k_scale, k_zero = k_tile
    v, v_scale, v_zero = v_tile
    qk = tl.dot(q[0], tl.trans(k[0]), input_precision="ieee")  # [R, BLOCK_N]
    if NUM_PLANES >= 2:
        qk = tl.dot(q[1], tl.trans(k[1]), qk, input_precision="ieee")
    if NUM_PLANES == 4:
        qk = tl.dot(q[2], tl.trans(k[2]), qk, input_precision="ieee")
        qk = tl.dot(q[3], tl.trans(k[3]), qk, input_precision="ieee")
    if BITS == 16:
        scores = qk * scale_log2
    else:
        # q . (codes - zero) * scale = (q . codes - zero * sum(q)) * scale
        scores = (qk - q_sum[:, None] * k_zero[None, :]) * (k_scale * scale_log2)[None, :]
    scores = tl.where(is_visible, scores, float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(scores, m_i, l_i, 1)
    acc0, acc1, acc2, acc3 = acc
    if BITS == 16:
        acc0 = acc0 * alpha[:, None] + tl.dot(p.to(q[0].dtype), v[0], input_precision="ieee")
    else:
        # p . (codes - zero) * scale = v_max * (w . codes - w . zero), w = p * scale / v_max in
        # [0, 1] (out of float16's subnormals), v_max the row's largest scale among the tokens it
        # sees (a tile's others depend on the chunk). The zero term uses w as rounded for the dot.
        v_max = tl.max(tl.where(is_visible, v_scale[None, :], 0.0), axis=1)
        v_max = tl.where(v_max > 0.0, v_max, 1.0)[:, None]  # [R, 1]
        w = (p * v_scale[None, :] / v_max).to(q[0].dtype)
        zero_term = tl.sum(w.to(tl.float32) * v_zero[None, :], axis=1)[:, None]
        acc0 = acc0 * alpha[:, None] + (tl.dot(w, v[0], input_precision="ieee") - zero_term) * v_max
        acc1 = acc1 * alpha[:, None] + (tl.dot(w, v[1], input_precision="ieee") - zero_term) * v_max
        if NUM_PLANES == 4:
            acc2 = acc2 * alpha[:, None] + (tl.dot(w, v[2], input_precision="ieee") - zero_term) * v_max
            acc3 = acc3 * alpha[:, None] + (tl.dot(w, v[3], input_precision="ieee") - zero_term) * v_max
    return m_new, l_i, (acc0, acc1, acc2, acc3)


@triton.jit
def _attend_by_token(
    query, state, is_visible, cache, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, WINDOW, ODD_X16
):
    # _attend_tile for decode, whose rows all see the same tokens (is_visible [BLOCK_N]), turned
    # over: q and acc planes [BLOCK_C, R], scores [BLOCK_N, R], so up to 8 query rows are one
    # 8-wide tensor-core tile. With ODD_X16 the INT4 planes 1 and 3 hold 16 * code: q's come
    # divided by 16, and V's take the 16 back in their zero term and v_max.
    q, q_sum, scale_log2 = query
    NUM_PLANES: tl.constexpr = 16 // BITS
    m_i, l_i, acc = state
    k_tile, v_tile = _load_kv(
        cache, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, q[0].dtype, WINDOW, True, ODD_X16
    )
    k, k_scale, k_zero = k_tile
    v, v_scale, v_zero = v_tile
    qk = tl.dot(k[0], q[0], input_precision="ieee")  # [BLOCK_N, R]
    if NUM_PLANES >= 2:
        qk = tl.dot(k[1], q[1], qk, input_precision="ieee")
    if NUM_PLANES == 4:
        qk = tl.dot(k[2], q[2], qk, input_precision="ieee")
        qk = tl.dot(k[3], q[3], qk, input_precision="ieee")
    if BITS == 16:
        scores = qk * scale_log2
    else:
        scores = (qk - k_zero[:, None] * q_sum[None, :]) * (k_scale * scale_log2)[:, None]
    scores = tl.where(is_visible[:, None], scores, float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(scores, m_i, l_i, 0)
    acc0, acc1, acc2, acc3 = acc
    if BITS == 16:
        acc0 = acc0 * alpha[None, :] + tl.dot(v[0], p.to(q[0].dtype), input_precision="ieee")
    else:
        # As in _attend_tile; every row sees the same tokens.
        v_max = tl.max(tl.where(is_visible, v_scale, 0.0), axis=0)
        v_max = tl.where(v_max > 0.0, v_max, 1.0)
        w = (p * (v_scale * (1.0 / v_max))[:, None]).to(q[0].dtype)
        zero_term = tl.sum(w.to(tl.float32) * v_zero[:, None], axis=0)[None, :]
        if ODD_X16:
            odd_zero_term, odd_v_max = zero_term * 16.0, v_max * (1.0 / 16.0)
        else:
            odd_zero_term, odd_v_max = zero_term, v_max
        acc0 = acc0 * alpha[None, :] + (tl.dot(v[0], w, input_precision="ieee") - zero_term) * v_max
        acc1 = acc1 * alpha[None, :] + (tl.dot(v[1], w, input_precision="ieee") - odd_zero_term) * odd_v_max
        if NUM_PLANES == 4:
            acc2 = acc2 * alpha[None, :] + (tl.dot(v[2], w, input_precision="ieee") - zero_term) * v_max
            acc3 = acc3 * alpha[None, :] + (tl.dot(v[3], w, input_precision="ieee") - odd_zero_term) * odd_v_max
    return m_new, l_i, (acc0, acc1, acc2, acc3)


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_kernel(
    q_ptr,
    cache,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    stride_qs,
    stride_qh,
    stride_bt,
    num_kv_heads,
    group_size,
    partition_tokens,
    num_splits,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    # One program per (sequence, KV head, partition): the group's query heads over its tokens.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # Partitions past this sequence's context do nothing (the merge reads only its own).
    num_parts = _num_partitions(context_len, partition_tokens, num_splits)
    if split >= num_parts:
        return
    start = split * partition_tokens
    end = tl.minimum(start + partition_tokens, context_len)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv = (kv_head, num_kv_heads, cache[8])
    rows, window_page, _, mask_n = _tokens(table_row, start + offs_n, end, kv, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS)

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < group_size
    heads = kv_head * group_size + offs_g
    # q rows of this KV head's group, padded to BLOCK_G (8 or more): [BLOCK_G, BLOCK_C] per plane
    q_rows = q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
    q, q_sum = _load_query_planes(q_rows, mask_g, HEAD_DIM, BITS, BLOCK_C)
    # INT4 subnormal codes keep nibbles 1 and 3 in place: q's planes 1 and 3 divided by 16 (exact,
    # or below 2**-10 to 2**-25, a quarter of float16's rounding there). The window pass undoes it.
    ODD_X16: tl.constexpr = BITS == 4 and q_ptr.dtype.element_ty == tl.float16
    q0, q1, q2, q3 = q
    if ODD_X16:
        q1, q3 = q1 * (1.0 / 16.0), q3 * (1.0 / 16.0)
    # q and the accumulators turned over, [BLOCK_C, BLOCK_G].
    q = (tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3))
    query = (q, q_sum, scale_log2)
    acc0 = tl.zeros([BLOCK_C, BLOCK_G], tl.float32)
    state = (
        tl.full([BLOCK_G], float("-inf"), tl.float32),
        tl.zeros([BLOCK_G], tl.float32),
        (acc0, acc0, acc0, acc0),
    )
    # Page numbers load two tiles ahead, scales and window tags one (too narrow for the compiler to
    # pipeline). With an FP16 window this loop reads the codes of every other token and notes the
    # first and last tiles with window tokens (per lane); a second pass reads those tokens, so the
    # main loop keeps the registers of pages without a window.
    scales = _tile_scales(cache, rows, mask_n, BITS)
    next_blocks = _table_blocks(table_row, start + BLOCK_N + offs_n, end, PAGE_SIZE)
    # Bounds that leave the window pass empty and cannot overflow in the pipelined loop.
    first_kept = tl.zeros([BLOCK_N], tl.int32) + end
    last_kept = tl.zeros([BLOCK_N], tl.int32) + (start - BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        next_positions = tile_start + BLOCK_N + offs_n
        next_tokens = _block_tokens(next_blocks, next_positions, end, kv, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS)
        next_rows, next_window_page, _, next_mask = next_tokens
        next_scales = _tile_scales(cache, next_rows, next_mask, BITS)
        next_blocks = _table_blocks(table_row, tile_start + 2 * BLOCK_N + offs_n, end, PAGE_SIZE)
        is_visible = _code_mask(mask_n, window_page, HAS_WINDOW)
        if HAS_WINDOW:
            is_kept = _kept_mask(mask_n, window_page, HAS_WINDOW)
            first_kept = tl.minimum(first_kept, tl.where(is_kept, tile_start, end))
            last_kept = tl.maximum(last_kept, tl.where(is_kept, tile_start, start - BLOCK_N))
        tokens = (rows, window_page, rows, mask_n)
        state = _attend_by_token(
            query, state, is_visible, cache, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, _CODES_ONLY, ODD_X16
        )
        mask_n, rows, window_page, scales = next_mask, next_rows, next_window_page, next_scales
    if HAS_WINDOW:
        if ODD_X16:
            query = ((q[0], q[1] * 16.0, q[2], q[3] * 16.0), q_sum, scale_log2)
        # Not pipelined (one or two tiles); at most WINDOW_N tokens a tile, as whole FP16 rows of
        # 128 tokens would take every register.
        WINDOW_N: tl.constexpr = min(BLOCK_N, WINDOW_TILE_TOKENS)
        offs_w = tl.arange(0, WINDOW_N)
        unused = tl.zeros([WINDOW_N], tl.float32)  # the pass's tokens have scale 1, zero 0
        unused = (unused, unused, unused, unused)
        for tile_start in tl.range(
            tl.min(first_kept, axis=0), tl.max(last_kept, axis=0) + BLOCK_N, WINDOW_N, num_stages=1
        ):
            tokens_w = _tokens(table_row, tile_start + offs_w, end, kv, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS)
            is_kept = _kept_mask(tokens_w[3], tokens_w[1], HAS_WINDOW)
            state = _attend_by_token(
                query, state, is_kept, cache, unused, tokens_w, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW, _KEPT_ONLY, False
            )

    m_i, l_i, acc = state
    has_tokens = l_i > 0.0
    denominator = tl.where(has_tokens, l_i, 1.0)[:, None]
    result = (
        tl.trans(acc[0]) / denominator,
        tl.trans(acc[1]) / denominator,
        tl.trans(acc[2]) / denominator,
        tl.trans(acc[3]) / denominator,
    )
    head_rows = seq.to(tl.int64) * num_kv_heads * group_size + heads  # [BLOCK_G]
    if IS_SPLIT:
        # partial_out: [num_seqs, num_heads, num_splits, HEAD_DIM]; partial_lse: [num_seqs, num_heads, num_splits]
        lse_offs = head_rows * num_splits + split
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + lse_offs, lse, mask=mask_g)
        _store_planes(partial_out_ptr + lse_offs[:, None] * HEAD_DIM, result, mask_g, HEAD_DIM, BITS, BLOCK_C)
    else:
        _store_planes(out_ptr + head_rows[:, None] * HEAD_DIM, result, mask_g, HEAD_DIM, BITS, BLOCK_C)


@triton.jit
def _num_partitions(context_len, partition_tokens, num_splits):
    # Partitions holding the sequence's tokens: at least one (empty context), at most num_splits.
    return tl.minimum(tl.maximum(tl.cdiv(context_len, partition_tokens), 1), num_splits)


@triton.jit
def _sum_lanes(x, ROWS: tl.constexpr, LANES: tl.constexpr):
    # [ROWS, LANES] -> [ROWS] by adding lanes 2i and 2i + 1 repeatedly: the same sum in any layout.
    for level in tl.static_range(1, LANES.bit_length()):
        x = tl.reshape(x, [ROWS, LANES >> level, 2])
        even, odd = tl.split(x)
        x = even + odd
    return tl.reshape(x, [ROWS])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_partitions_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    context_lens_ptr,
    partition_tokens,
    num_splits,
    HEAD_DIM: tl.constexpr,
    SLICE_D: tl.constexpr,
    LANES: tl.constexpr,
):
    # One program per (sequence, head, SLICE_D columns): the partials weighted by exp2(lse - max),
    # LANES partitions at a time (partition s in lane s % LANES), the sums rescaled when a chunk
    # raises the maximum, then the lanes added pairwise.
    seq = tl.program_id(0)
    row = seq.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    num_parts = _num_partitions(tl.load(context_lens_ptr + seq), partition_tokens, num_splits)
    offs_d = tl.program_id(2) * SLICE_D + tl.arange(0, SLICE_D)
    offs_l = tl.arange(0, LANES)
    mask_d = offs_d < HEAD_DIM
    lse_row = partial_lse_ptr + row * num_splits
    part_row = partial_out_ptr + row * num_splits * HEAD_DIM
    max_lse = float("-inf")
    total = tl.zeros([1, LANES], tl.float32)
    acc = tl.zeros([SLICE_D, LANES], tl.float32)
    for chunk_start in range(0, num_parts, LANES):
        splits = chunk_start + offs_l
        is_part = splits < num_parts
        lse = tl.load(lse_row + splits, mask=is_part, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            part_row + offs_d[:, None] + splits[None, :] * HEAD_DIM,
            mask=mask_d[:, None] & is_part[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        new_max = tl.maximum(max_lse, tl.max(lse, axis=0))
        # -inf until a partition has tokens: weights 0 then.
        reference = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(max_lse - reference)  # 0 on the first chunk, 1 while the max holds
        weight = tl.exp2(lse - reference)[None, :]  # 0 past num_parts: adds exact zeros
        total = total * rescale + weight
        acc = acc * rescale + part * weight
        max_lse = new_max
    total = _sum_lanes(total, 1, LANES)
    result = _sum_lanes(acc, SLICE_D, LANES) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, result.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _prefill_kernel(
    q_ptr,
    cache,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    strides,
    num_kv_heads,
    group_size,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
):
    stride_qt, stride_qh, stride_bt, stride_ot, stride_oh = strides
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group_size
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    num_cached = context_len - q_len
    # Query tiles sit at absolute positions, like K/V tiles: a token meets the same tiles in the
    # same row whatever chunk of the prompt it comes in.
    q_tile = num_cached // BLOCK_M + tl.program_id(0)

    q_positions = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = (q_positions >= num_cached) & (q_positions < context_len)
    token_rows = (q_start + q_positions - num_cached).to(tl.int64)
    q, q_sum = _load_query_planes(
        q_ptr + token_rows[:, None] * stride_qt + head * stride_qh, mask_m, HEAD_DIM, BITS, BLOCK_C
    )
    query = (q, q_sum, scale_log2)

    # K/V up to the last query of this tile (causal); none when the tile has no new token.
    end = tl.minimum(context_len, (q_tile + 1) * BLOCK_M)
    end = tl.where((q_tile * BLOCK_M < context_len) & (q_len > 0), end, 0)

    acc0 = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    state = (
        tl.full([BLOCK_M], float("-inf"), tl.float32),
        tl.zeros([BLOCK_M], tl.float32),
        (acc0, acc0, acc0, acc0),
    )
    kv = (kv_head, num_kv_heads, cache[8])
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Position 0 is in the first tile and visible to every query, so m_i is finite after it.
    for tile_start in range(0, end, BLOCK_N):
        positions = tile_start + offs_n
        tokens = _tokens(table_row, positions, end, kv, PAGE_SIZE, HAS_WINDOW, WIDE_OFFSETS)
        scales = _tile_scales(cache, tokens[0], tokens[3], BITS)
        is_visible = tokens[3][None, :] & (positions[None, :] <= q_positions[:, None])  # [BLOCK_M, BLOCK_N]
        state = _attend_tile(query, state, is_visible, cache, scales, tokens, HEAD_DIM, BLOCK_C, BITS, HAS_WINDOW)

    _, l_i, acc = state
    denominator = tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    result = (acc[0] / denominator, acc[1] / denominator, acc[2] / denominator, acc[3] / denominator)
    _store_planes(out_ptr + token_rows[:, None] * stride_ot + head * stride_oh, result, mask_m, HEAD_DIM, BITS, BLOCK_C)
