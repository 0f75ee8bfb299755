"""The sampler: greedy, temperature, top-k, top-p, min-p and penalties, on the host or the device."""

from __future__ import annotations

import torch

from lowvram.core.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row of logits [V]."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the ones before it already reach top_p
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_token_masks(logits: torch.Tensor, rows: list[int], seqs: list) -> torch.Tensor:
    """FP32 logits [S, V] with each constrained sequence's row set to -inf where its grammar forbids
    the token; unchanged (no copy) when no sequence is constrained. The masks are computed on the host,
    one packed int32 word per 32 tokens, and unpacked on the logits' device."""
    masked = [(rows[i], seq.matcher) for i, seq in enumerate(seqs) if seq.matcher is not None]
    if not masked:
        return logits
    # A copy: the logits may be a view of the CUDA graphs' buffer, which must not change.
    logits, vocab_size = logits.clone(), logits.shape[-1]
    words = torch.stack([torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32) for _, m in masked])
    words = words.to(logits.device, non_blocking=True)  # [M, ceil(V' / 32)]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).flatten(1).bool()  # [M, 32 * words]
    if allowed.shape[1] < vocab_size:  # ids past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    index = torch.tensor([row for row, _ in masked], device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab_size], float("-inf"))
    return logits


def sample_token(
    logits: torch.Tensor, params: SamplingParams, rng: torch.Generator | None, prompt: list[int], output: list[int]
) -> int:
    """Pick the next token from one row of FP32 logits [V]. Repetition penalty as in CTRL/HF,
    presence/frequency penalties as in OpenAI."""
    # A copy: the row may be a view of the CUDA graphs' logits buffer, which must not change.
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        if seen.numel():
            picked, penalty = logits[seen], params.repetition_penalty
            logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        ids, counts = torch.tensor(output, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    if rng is not None and probs.device != rng.device:
        # A seeded request draws from its own host generator, alike on any device and batch.
        probs = probs.to(rng.device)
    return int(torch.multinomial(probs, 1, generator=rng))


def gumbel_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token (0-d, on the device) from FP32 logits [V] by the Gumbel-max trick: no wait for the host."""
    filtered = filter_logits(logits, params)
    uniform = torch.rand(filtered.shape, generator=generator, device=filtered.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))
    return torch.argmax(filtered + gumbel)


def _argmax_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return torch.argmax(logits if rows == list(range(logits.shape[0])) else logits[rows], dim=-1)


def sample_tokens_on_device(logits: torch.Tensor, rows: list[int], seqs: list) -> torch.Tensor:
    """As sample_tokens, left on the device ([len(rows)] int64, no wait); no row may have penalties."""
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy = [i for i, seq in enumerate(seqs) if seq.params.is_greedy]
    if greedy:
        if len(greedy) == len(rows):
            return _argmax_rows(logits, rows)
        tokens[greedy] = _argmax_rows(logits, [rows[i] for i in greedy])
    for i, seq in enumerate(seqs):
        if not seq.params.is_greedy:
            tokens[i] = gumbel_sample(logits[rows[i]], seq.params, device_generator(seq, logits.device))
    return tokens


def device_generator(seq, device: torch.device) -> torch.Generator | None:
    """The sequence's generator on `device`, made from its seed on first use (None without one)."""
    if seq.params.seed is None:
        return None
    if seq.device_generator is None:
        seq.device_generator = torch.Generator(device=device).manual_seed(seq.params.seed)
    return seq.device_generator


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def sample_tokens(logits: torch.Tensor, rows: list[int], seqs: list, on_device: bool = False) -> list[int]:
    """Next token of each sequence from its row of FP32 logits [S, V]; with `on_device`, rows without
    penalties draw as on the device. Plain greedy rows share one argmax and one host copy."""
    plain = [i for i, seq in enumerate(seqs) if seq.params.is_greedy and not has_penalties(seq.params)]
    tokens = [0] * len(seqs)
    for i, token in zip(plain, _argmax_rows(logits, [rows[i] for i in plain]).tolist() if plain else []):
        tokens[i] = token
    for i in sorted(set(range(len(seqs))).difference(plain)):
        seq, row = seqs[i], logits[rows[i]]
        if on_device and not has_penalties(seq.params):
            tokens[i] = int(gumbel_sample(row, seq.params, device_generator(seq, logits.device)))
        else:
            tokens[i] = sample_token(row, seq.params, seq.generator, seq.prompt_token_ids, seq.output_token_ids)
    return tokens


def top_logprobs(logprobs: torch.Tensor, targets: list[int], ks: list[int]) -> list[tuple[float, list]]:
    """Per row of log-probabilities [R, V]: the target's, and the ks[row] likeliest (id, log-probability)."""
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])[:, 0].tolist()
    top = logprobs.topk(max(ks), dim=-1) if max(ks) else None  # sorted, likeliest first
    ids, values = (top.indices.tolist(), top.values.tolist()) if top is not None else ([[]] * len(ks), [[]] * len(ks))
    return [(c, list(zip(i[:k], v[:k]))) for c, i, v, k in zip(chosen, ids, values, ks)]


def sampled_logprobs(logits: torch.Tensor, rows: list[int], seqs: list, tokens: list[int]) -> dict[int, tuple]:
    """For the sequences that ask (params.logprobs), by their row: the sampled token's log-probability
    under the model's distribution (log-softmax of the raw logits [S, V]) and the likeliest alternatives."""
    asking = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not asking:
        return {}
    logprobs = torch.log_softmax(logits[[rows[i] for i in asking]].float(), dim=-1)  # [A, V]
    entries = top_logprobs(logprobs, [tokens[i] for i in asking], [seqs[i].params.logprobs for i in asking])
    return {rows[i]: entry for i, entry in zip(asking, entries)}


def prompt_logprobs(logits: torch.Tensor, seqs: list, positions: list[int], num_new_tokens: list[int]) -> dict:
    """For the sequences that ask (params.prompt_logprobs), by their row: (the first prompt position
    scored, its entries), from a prefill's logits at every new token [T, V]; each row predicts the next."""
    scored, first = {}, 0
    for row, (seq, start, num_new) in enumerate(zip(seqs, positions, num_new_tokens)):
        targets = seq.prompt_token_ids[start + 1 : start + num_new + 1]
        if seq.params.prompt_logprobs is not None and targets:
            logprobs = torch.log_softmax(logits[first : first + len(targets)].float(), dim=-1)  # [len(targets), V]
            scored[row] = (start + 1, top_logprobs(logprobs, targets, [seq.params.prompt_logprobs] * len(targets)))
        first += num_new
    return scored
