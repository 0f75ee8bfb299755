from lowvram.core.block_manager import BlockManager
from lowvram.core.sampling_params import SamplingParams
from lowvram.core.scheduler import Scheduler
from lowvram.core.sequence import Sequence


def _seq(seq_id: int, num_prompt: int) -> Sequence:
    return Sequence(seq_id, str(seq_id), None, list(range(1, num_prompt + 1)), SamplingParams(), detokenizer=None)


def _scheduler_with(block_manager: BlockManager, *seqs: Sequence) -> Scheduler:
    """A scheduler of up to 4 sequences and 100 tokens a step, with seqs added in order."""
    sched = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=100)
    for seq in seqs:
        sched.waiting.append(seq)
    return sched


def _finish_step(batch):
    """What the engine does after a step: advance, and sample one token where a sequence caught up."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_uncomputed_tokens == 0:
            seq.output_token_ids.append(5)


def test_prefill_respects_token_budget_and_chunks_long_prompts():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=10)
    a, b = _seq(0, 7), _seq(1, 12)
    sched.waiting.append(a)
    sched.waiting.append(b)
    batch = sched.schedule()
    assert batch.is_prefill and [s.seq_id for s in batch.seqs] == [0, 1] and batch.num_new_tokens == [7, 3]
    _finish_step(batch)
    batch = sched.schedule()  # b continues its prefill before anyone decodes
    assert batch.is_prefill and [s.seq_id for s in batch.seqs] == [1] and batch.num_new_tokens == [9]
    _finish_step(batch)
    batch = sched.schedule()
    assert not batch.is_prefill and [s.seq_id for s in batch.seqs] == [0, 1] and batch.num_new_tokens == [1, 1]


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [_seq(i, 3) for i in range(3)]
    for s in seqs:
        sched.waiting.append(s)
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == [0, 1]
    assert list(sched.waiting) == [seqs[2]]


def test_decode_preempts_newest_and_resumes_it_first():
    bm = BlockManager(4, 4)
    a, b = _seq(0, 8), _seq(1, 7)
    sched = _scheduler_with(bm, a, b)
    _finish_step(sched.schedule())  # a: 8 prompt + 1 out = 9 tokens (needs 3 pages), b: 7 + 1 = 8 (2 pages)
    batch = sched.schedule()
    # a needs a third page, none is free: b (newest) is preempted and its pages freed
    assert [s.seq_id for s in batch.preempted] == [1]
    assert [s.seq_id for s in batch.seqs] == [0]
    assert b not in sched.running and b.num_computed_tokens == 0 and bm.block_table(1) == []
    assert sched.waiting[0] is b
    sched.finish(a)
    assert bm.num_free_blocks == 4
    batch = sched.schedule()  # b resumes: its first full page is a prefix-cache hit, the rest is recomputed
    assert batch.is_prefill and batch.seqs == [b] and batch.num_new_tokens == [4] and batch.positions == [4]


def test_decode_takes_a_new_page_exactly_when_the_last_one_is_full():
    bm = BlockManager(8, 4)
    a, b = _seq(0, 6), _seq(1, 3)
    sched = _scheduler_with(bm, a, b)
    _finish_step(sched.schedule())  # prefill: a holds pages [0, 1], b [2]
    tables = []
    for _ in range(4):
        batch = sched.schedule()
        assert not batch.is_prefill and batch.seqs == [a, b] and batch.num_new_tokens == [1, 1]
        tables.append((list(bm.block_table(0)), list(bm.block_table(1)), bm.num_free_blocks))
        _finish_step(batch)
    # b's 5th token opens page 3 in the second step; a's 9th token opens page 4 in the third.
    assert tables == [([0, 1], [2], 5), ([0, 1], [2, 3], 4), ([0, 1, 4], [2, 3], 3), ([0, 1, 4], [2, 3], 3)]


def test_resume_without_prefix_caching_recomputes_everything():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    a, b = _seq(0, 8), _seq(1, 7)
    sched = _scheduler_with(bm, a, b)
    _finish_step(sched.schedule())
    assert [s.seq_id for s in sched.schedule().preempted] == [1]
    sched.finish(a)
    batch = sched.schedule()
    assert batch.seqs == [b] and batch.num_new_tokens == [8]


def test_a_new_request_starts_from_a_finished_one_s_pages():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    first = _seq(0, 10)
    sched.waiting.append(first)
    batch = sched.schedule()
    _finish_step(batch)
    for seq, _ in zip(batch.seqs, batch.num_new_tokens):
        bm.commit(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens)
    sched.finish(first)  # 10 computed tokens: 2 full pages cached + a partial page of 2
    follow = Sequence(1, "1", None, first.prompt_token_ids + [5, 9, 9], SamplingParams(), detokenizer=None)
    sched.waiting.append(follow)
    batch = sched.schedule()
    # 8 tokens shared, 2 copied from the partial page, 3 left to compute
    assert batch.seqs == [follow] and batch.positions == [10] and batch.num_new_tokens == [3]
    assert batch.copies == [(2, bm.block_table(1)[2])]


def test_finish_frees_pages_of_waiting_and_running():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    a, b = _seq(0, 5), _seq(1, 5)
    sched.waiting.append(a)
    sched.waiting.append(b)
    sched.schedule()
    sched.finish(b)  # aborted while waiting
    sched.finish(a)  # aborted while running
    assert bm.num_free_blocks == 8 and not sched.waiting and not sched.running


def test_lowering_the_batch_limit_preempts_the_newest_and_raising_it_readmits():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    seqs = [_seq(i, 3) for i in range(4)]
    for s in seqs:
        sched.waiting.append(s)
    _finish_step(sched.schedule())
    assert [s.seq_id for s in sched.running] == [0, 1, 2, 3]
    preempted = sched.set_batch_limit(2)
    assert [s.seq_id for s in preempted] == [3, 2]
    assert [s.seq_id for s in sched.running] == [0, 1] and [s.seq_id for s in sched.waiting] == [2, 3]
    batch = sched.schedule()
    assert not batch.is_prefill and [s.seq_id for s in batch.seqs] == [0, 1]  # nothing admitted over the limit
    sched.set_batch_limit(4)
    batch = sched.schedule()
    assert batch.is_prefill and [s.seq_id for s in batch.seqs] == [2, 3]


def test_throttling_holds_new_requests_but_not_preempted_ones():
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=100)
    first, second = _seq(0, 3), _seq(1, 3)
    sched.waiting.append(first)
    _finish_step(sched.schedule())
    sched.is_throttled = True
    sched.waiting.append(second)
    batch = sched.schedule()
    assert not batch.is_prefill and batch.seqs == [first]  # the new request waits
    assert second in sched.waiting
    sched.is_throttled = False
    assert sched.schedule().seqs == [second]


def test_throttling_never_starves_an_idle_engine():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=100)
    sched.is_throttled = True
    seq = _seq(0, 3)
    sched.waiting.append(seq)
    assert sched.schedule().seqs == [seq]


def test_token_ids_between_is_a_slice_of_all_token_ids():
    seq = _seq(0, 5)
    seq.output_token_ids.extend([50, 51, 52])
    every = seq.all_token_ids
    assert [seq.token_ids_between(a, b) for a in range(9) for b in range(a, 10)] == [
        every[a:b] for a in range(9) for b in range(a, 10)
    ]


def test_equal_looking_sequences_are_different_requests():
    # Queues hold sequences by identity: a twin request is another entry, not the same one.
    a, twin = _seq(0, 4), _seq(0, 4)
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=4, max_num_batched_tokens=100)
    sched.waiting.append(a)
    sched.waiting.append(twin)
    sched.finish(twin)
    assert list(sched.waiting) == [a] and sched.waiting[0] is a and a != twin


def test_a_batch_carries_the_pages_the_runner_needs():
    """Block tables of the scheduled sequences (after allocation, in order), every live table,
    and the free pages: what the model runner reads instead of the block manager."""
    manager = BlockManager(16, 4, enable_prefix_caching=False)
    a, b, c = _seq(0, 5), _seq(1, 3), _seq(2, 6)
    sched = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)
    for seq in (a, b, c):
        sched.waiting.append(seq)
    batch = sched.schedule()  # a (5 tokens) and b (3) fill the budget; c waits
    assert [s.seq_id for s in batch.seqs] == [0, 1]
    assert batch.block_tables == [[0, 1], [2]]
    assert dict(batch.live_tables) == {0: [0, 1], 1: [2]}
    assert sorted(batch.free_block_ids) == list(range(3, 16))
    _finish_step(batch)
    batch = sched.schedule()  # c's prefill alone: the decoding ones keep their pages
    assert [s.seq_id for s in batch.seqs] == [2] and batch.block_tables == [[3, 4]]
    assert dict(batch.live_tables) == {0: [0, 1], 1: [2], 2: [3, 4]}


def test_a_prompt_to_score_skips_the_prefix_cache_and_is_chunked_small():
    from lowvram.core.scheduler import MAX_SCORED_TOKENS

    bm = BlockManager(256, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=1000)
    cached = _seq(0, 300)
    sched.waiting.append(cached)
    _finish_step(sched.schedule())
    bm.commit(cached.seq_id, cached.all_token_ids, cached.num_computed_tokens)
    sched.finish(cached)  # its pages stay cached
    plain, scored = _seq(1, 300), _seq(2, 300)
    scored.params = SamplingParams(prompt_logprobs=1)
    sched.waiting.extend([plain, scored])
    batch = sched.schedule()
    assert plain.num_computed_tokens == 296  # a hit: all full pages but the last token's
    assert batch.seqs == [plain, scored] and batch.num_new_tokens == [4, MAX_SCORED_TOKENS]
    assert scored.num_computed_tokens == 0 and batch.positions == [296, 0]
