"""Decode steps replayed from CUDA graphs: buckets on the CPU, equality with eager steps on a GPU."""

import pytest
import torch

from lowvram.config import load_profile
from lowvram.core.sampling_params import SamplingParams
from lowvram.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, batch_buckets, table_buckets, token_buckets
from lowvram.engine.engine import LLMEngine

EAGER = load_profile("4gb").replace(enable_cuda_graphs=False)
GRAPHED = load_profile("4gb").replace(enable_cuda_graphs=True)


def test_batch_buckets_double_up_to_the_largest_batch():
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]


def test_table_buckets_grow_by_four_up_to_the_longest_context():
    assert table_buckets(1024) == [64, 256, 1024]
    assert table_buckets(8192 + 1) == [64, 256, 1024, 4096, 8193]
    assert table_buckets(10) == [10]


def test_a_batch_gets_the_smallest_bucket_that_holds_it():
    graphs = DecodeGraphs(lambda *a: None, max_num_seqs=8, max_blocks_per_seq=1024, device=torch.device("cpu"))
    assert graphs.bucket(3, 65) == (4, 256)
    assert graphs.bucket(8, 1024) == (8, 1024)
    assert graphs.bucket(9, 10) is None and graphs.bucket(1, 1025) is None
    graphs.failed.add((4, 256))
    assert graphs.bucket(3, 65) is None  # a bucket whose capture failed runs eagerly


def test_prefill_graphs_take_one_sequence_of_up_to_their_largest_bucket():
    assert token_buckets(512) == [64, 128, 256, 512]
    assert token_buckets(100) == [64, 100] and token_buckets(32) == [32]
    graphs = PrefillGraphs(lambda *a: None, max_tokens=512, max_blocks_per_seq=1024, device=torch.device("cpu"))
    assert graphs.bucket(70, 65) == (128, 256)
    assert graphs.bucket(1, 1) == (64, 64)
    assert graphs.bucket(513, 10) is None and graphs.bucket(10, 1025) is None


def test_decode_inputs_are_staged_into_the_static_tensors_with_padding_rows_emptied():
    graphs = DecodeGraphs(lambda *a: None, max_num_seqs=4, max_blocks_per_seq=300, device=torch.device("cpu"))
    # A full batch over wide tables first, so the smaller step after it has stale values to overwrite.
    graphs._fill([1, 2, 3, 4], [70, 71, 72, 73], [5, 6, 7, 8], [71, 72, 73, 74], [list(range(10, 80))] * 4, 4, 256)
    graphs._fill([11, 12, 13], [3, 40, 5], [33, 640, 85], [4, 41, 6], [[2], [4, 5, 6], [9]], 4, 64)
    assert graphs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert graphs.positions[:4].tolist() == [3, 40, 5, 0]
    assert graphs.slot_mapping[:4].tolist() == [33, 640, 85, -1]  # the padding row stores no KV
    assert graphs.context_lens[:4].tolist() == [4, 41, 6, 0]  # and attends to nothing
    tables = graphs.block_tables[: 4 * 64].view(4, 64)  # [4, 64]: what the (4, 64) graph reads
    assert tables[:, :3].tolist() == [[2, 0, 0], [4, 5, 6], [9, 0, 0], [0, 0, 0]]
    assert not tables[:, 3:].any()
    assert tables.data_ptr() == graphs.block_tables.data_ptr()  # every bucket reads the same static buffer


def test_prefill_inputs_are_staged_with_an_empty_padding_sequence():
    graphs = PrefillGraphs(lambda *a: None, max_tokens=128, max_blocks_per_seq=300, device=torch.device("cpu"))
    graphs._fill(list(range(100)), list(range(100)), list(range(100)), [100], [list(range(80))], 128, 256)
    graphs._fill([7, 8, 9], [16, 17, 18], [160, 161, 162], [19], [[3, 4]], 64, 64)
    assert graphs.input_ids[:5].tolist() == [7, 8, 9, 0, 0] and not graphs.input_ids[3:64].any()
    assert graphs.positions[:4].tolist() == [16, 17, 18, 0]
    assert graphs.slot_mapping[:3].tolist() == [160, 161, 162] and (graphs.slot_mapping[3:64] == -1).all()
    assert graphs.context_lens.tolist() == [19, 0] and graphs.cu_seqlens.tolist() == [0, 3, 64]
    assert graphs.last_row.tolist() == [2]
    tables = graphs.block_tables[:128].view(2, 64)  # [the sequence, the padding]
    assert tables[0, :3].tolist() == [3, 4, 0] and not tables[0, 2:].any() and not tables[1].any()


def test_the_cpu_runs_eagerly(tiny_qwen2_dir):
    engine = LLMEngine(str(tiny_qwen2_dir), load_profile("cpu").replace(enable_cuda_graphs=True))
    assert engine.runner.graphs is None


def _generate(engine, prompts, max_tokens, *, switch_to=None):
    for i, ids in enumerate(prompts):
        limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        params = SamplingParams(temperature=0, max_tokens=limit, ignore_eos=True)
        engine.add_request(str(i), None, params, prompt_token_ids=ids)
    outputs, num_steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        num_steps += 1
        if switch_to and num_steps == 6:
            engine.set_kv_precision(switch_to)
    return outputs


def _prompts(engine, lengths):
    vocab = engine.config.vocab_size
    return [[(7 * i + 13 * n) % (vocab - 10) + 5 for i in range(n)] for n in lengths]


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_graph_replay_gives_the_eager_tokens(fixture, request):
    """Batches shrink as requests finish (4 -> 1) and one context crosses the 64-page bucket."""
    model_dir = str(request.getfixturevalue(fixture))
    profile = {"max_model_len": 4096, "emulate_vram_gib": 4.0}
    eager = LLMEngine(model_dir, EAGER, **profile)
    graphed = LLMEngine(model_dir, GRAPHED, **profile)
    prompts = _prompts(eager, [5, 40, 300, 1010])
    max_tokens = [12, 18, 6, 30]  # the longest prompt decodes alone at the end, past 64 pages
    expected = _generate(eager, prompts, max_tokens)
    got = _generate(graphed, prompts, max_tokens)
    graphs = graphed.runner.graphs
    print(f"{fixture}: {graphs.num_captures} graphs captured, {graphs.num_replays} replays")
    assert got == expected
    assert graphs.num_replays > 0
    # The widest table (1040 tokens in 16-token pages) is past 64 pages: the next bucket is
    # 256 pages or the model's whole context, whichever is smaller.
    assert graphs.table_widths[0] == 64 and graphs.table_widths[1] > 64
    assert {batch for batch, _ in graphs.graphs} == {1, 2, 4}
    assert {width for _, width in graphs.graphs} == set(graphs.table_widths[:2])


@pytest.mark.gpu
def test_a_precision_change_recaptures_the_graphs(tiny_qwen2_dir):
    profile = {"max_model_len": 2048, "emulate_vram_gib": 4.0}
    eager = LLMEngine(str(tiny_qwen2_dir), EAGER, **profile)
    graphed = LLMEngine(str(tiny_qwen2_dir), GRAPHED, **profile)
    prompts = _prompts(eager, [12, 100, 33])
    expected = _generate(eager, prompts, 20, switch_to="int8")
    got = _generate(graphed, prompts, 20, switch_to="int8")
    assert graphed.kv_precision == "int8"
    assert got == expected
    assert graphed.runner.graphs.num_captures > len(graphed.runner.graphs.graphs)  # some were dropped and redone


@pytest.mark.gpu
def test_graph_logits_match_eager_logits(tiny_llama_dir):
    profile = {"max_model_len": 2048, "emulate_vram_gib": 4.0}
    engines = [LLMEngine(str(tiny_llama_dir), p, **profile) for p in (EAGER, GRAPHED)]
    recorded = []
    for engine in engines:
        rows = []
        run = engine.runner.run

        def recording_run(batch, run=run, rows=rows, **kwargs):
            logits = run(batch, **kwargs)
            if not batch.is_prefill:
                rows.append(logits.cpu())
            return logits

        engine.runner.run = recording_run
        _generate(engine, _prompts(engine, [9, 70]), 12)
        recorded.append(torch.cat(rows))
    worst = ((recorded[0] - recorded[1]).abs().max() / recorded[0].abs().max()).item()
    print(f"graph vs eager decode logits: largest relative difference {worst:.2e}")
    assert worst <= 2e-3


@pytest.mark.gpu
def test_replays_queued_faster_than_the_gpu_runs_each_read_their_own_inputs(tiny_qwen2_dir):
    """Staged inputs go over in asynchronous copies from one pinned buffer: with the GPU held
    back, the host must not overwrite a step's inputs before their copy has read them."""
    from lowvram.kv.attention import AttentionMetadata

    engine = LLMEngine(
        str(tiny_qwen2_dir), GRAPHED.replace(kv_backend="device"), max_model_len=2048, emulate_vram_gib=4.0
    )
    prompt = _prompts(engine, [40])[0]
    engine.add_request("0", None, SamplingParams(temperature=0, max_tokens=100), prompt_token_ids=prompt)
    engine.step()  # the prefill: 40 tokens of real KV, the next position is 40
    runner, seq = engine.runner, engine.requests["0"]
    table = engine.kv_pool.device_table(engine.block_manager.block_table(seq.seq_id))
    slot = table[40 // runner.block_size] * runner.block_size + 40 % runner.block_size
    key = runner.graphs.bucket(1, len(table))
    token_ids = [(37 * i) % (engine.config.vocab_size - 10) + 5 for i in range(24)]
    # Every step writes its own token's KV at position 40 before reading it: steps are independent.
    with torch.inference_mode():
        runner.graphs.run(key, [token_ids[0]], [40], [slot], [41], [table], runner.kv_pool.pages)  # captures
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of every copy below
        replayed = [
            runner.graphs.run(key, [t], [40], [slot], [41], [table], runner.kv_pool.pages).clone() for t in token_ids
        ]
        eager = []
        dev = engine.device
        for t in token_ids:
            meta = AttentionMetadata(
                False,
                torch.tensor([slot], device=dev),
                torch.tensor([table], dtype=torch.int32, device=dev),
                torch.tensor([41], dtype=torch.int32, device=dev),
                torch.tensor([0, 1], dtype=torch.int32, device=dev),
                41,
                [41],
                [1],
            )
            ids, pos = torch.tensor([t], device=dev), torch.tensor([40], device=dev)
            eager.append(runner._logits(ids, pos, meta, runner.kv_pool.pages))
    replayed, eager = torch.cat(replayed), torch.cat(eager)  # [24, vocab]
    worst = ((replayed - eager).abs().max() / eager.abs().max()).item()
    print(f"{len(token_ids)} queued replays vs eager steps: largest relative logit difference {worst:.2e}")
    assert worst <= 2e-3
    assert len(set(replayed.argmax(-1).tolist())) > 1  # the inputs really changed the logits


@pytest.mark.gpu
def test_an_embedding_table_in_host_memory_gives_the_same_tokens(tiny_qwen2_dir):
    """The GPU reads the pinned table's rows itself, inside the graphs (no staging on the host)."""
    profile = {"max_model_len": 2048, "emulate_vram_gib": 4.0}
    on_device = LLMEngine(str(tiny_qwen2_dir), GRAPHED.replace(embeddings_on_host=False), **profile)
    on_host = LLMEngine(str(tiny_qwen2_dir), GRAPHED.replace(embeddings_on_host=True), **profile)
    assert not on_device.config.is_tied_head
    table = on_device.model.model.embed_tokens.weight
    assert table.is_cuda and on_host.model.model.embed_tokens.weight.device.type == "cpu"
    # The engine plans from what loading allocated (allocator rounding included), so the
    # difference is the table's bytes give or take a few rounded blocks.
    moved = on_device.model.weight_bytes - on_host.model.weight_bytes
    assert abs(moved - table.numel() * table.element_size()) <= 4096
    prompts = _prompts(on_device, [5, 40, 300])
    expected = _generate(on_device, prompts, [12, 18, 6])
    assert _generate(on_host, prompts, [12, 18, 6]) == expected
    embed = on_host.model.model.embed_tokens
    assert embed.weight.is_pinned() and embed.device_view is not None and embed.device_view.is_cuda
    assert on_host.runner.graphs.num_replays > 0 and on_host.runner.graphs.stage_embeddings is None
    assert on_host.stats.num_pipelined_steps > 0


@pytest.mark.gpu
def test_pipelined_decode_gives_the_tokens_of_steps_run_one_by_one(tiny_qwen2_dir):
    """Each decode step queued from the previous one's argmax on the device, before the host
    reads it: batches shrink as requests finish, one crosses pages, one stops on a token."""
    profile = {"max_model_len": 2048, "emulate_vram_gib": 4.0}
    steady = LLMEngine(str(tiny_qwen2_dir), GRAPHED.replace(pipelined_decode=False), **profile)
    piped = LLMEngine(str(tiny_qwen2_dir), GRAPHED.replace(embeddings_on_host=True), **profile)
    assert piped.pipelines_decode
    prompts = _prompts(steady, [5, 40, 300, 17])
    expected = _generate(steady, prompts, [12, 18, 40, 25])
    got = _generate(piped, prompts, [12, 18, 40, 25])
    assert got == expected
    assert steady.stats.num_pipelined_steps == 0 and piped.stats.num_pipelined_steps > 30
    assert piped.runner.graphs.num_replays > 0
    # a stop token: the step queued after it is dropped
    stop = expected["2"][20]
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
    for engine in (steady, piped):
        engine.add_request("stop", None, params, prompt_token_ids=prompts[2])
    outs = [
        [o for _ in range(200) if e.has_unfinished_requests() for o in e.step() if o.finished] for e in (steady, piped)
    ]
    assert (
        outs[0][0].outputs[0].token_ids
        == outs[1][0].outputs[0].token_ids
        == expected["2"][: expected["2"].index(stop) + 1]
    )


@pytest.mark.gpu
def test_seeded_sampling_on_the_gpu_is_the_same_alone_and_batched(tiny_qwen2_dir):
    """A seeded request draws from its host generator though its logits are on the GPU; greedy
    neighbours are pipelined around it."""
    engine = LLMEngine(str(tiny_qwen2_dir), GRAPHED, max_model_len=2048, emulate_vram_gib=4.0)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    prompt = _prompts(engine, [30])[0]

    def run(requests):
        for request_id, params in requests.items():
            engine.add_request(request_id, None, params, prompt_token_ids=prompt)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return done

    alone = run({"s": seeded})["s"]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    batched = run({"g1": greedy, "s": seeded, "g2": greedy, "u": SamplingParams(temperature=1.0, max_tokens=9)})
    assert len(alone) == 20 and batched["s"] == alone and len(batched["u"]) <= 9


@pytest.mark.gpu
def test_pinned_rows_are_read_by_the_gpu_inside_a_graph():
    from lowvram.models.layer_streaming import HostEmbedding

    table = torch.randn(1000, 64, dtype=torch.float16)
    embed = HostEmbedding(table, torch.device("cuda"))
    assert embed.weight.is_pinned() and embed.device_view is not None
    ids = torch.tensor([3, 999, 0, 3, 517], device="cuda")
    assert torch.equal(embed(ids).cpu(), table[ids.cpu()])
    static_ids = torch.zeros(5, dtype=torch.long, device="cuda")
    embed(static_ids)  # warm-up off the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embed(static_ids)
    for _ in range(2):
        new = torch.randint(0, 1000, (5,), device="cuda")
        static_ids.copy_(new)
        graph.replay()
        assert torch.equal(out.cpu(), table[new.cpu()])


@pytest.mark.gpu
def test_prefill_graphs_give_the_eager_logits_and_tokens(tiny_qwen2_dir):
    """Prompts of several buckets, one after a cached prefix; a prompt past the largest bucket runs eagerly."""
    profile = {"max_model_len": 2048, "emulate_vram_gib": 4.0}
    eager = LLMEngine(str(tiny_qwen2_dir), GRAPHED, **profile)
    graphed = LLMEngine(str(tiny_qwen2_dir), GRAPHED.replace(enable_prefill_graphs=True), **profile)
    prompts = _prompts(eager, [5, 100, 300, 700])
    prompts.append(prompts[2][:200] + [9, 8, 7])  # 200 cached tokens, then 3 new ones
    recorded = []
    for engine in (eager, graphed):
        rows = []
        run = engine.runner.run

        def recording_run(batch, run=run, rows=rows, **kwargs):
            logits = run(batch, **kwargs)
            if batch.is_prefill:
                rows.append(logits.cpu())
            return logits

        engine.runner.run = recording_run
        tokens = [_generate(engine, [p], 8)["0"] for p in prompts]
        recorded.append((torch.cat(rows), tokens))
    (eager_logits, eager_tokens), (graph_logits, graph_tokens) = recorded
    worst = ((eager_logits - graph_logits).abs().max() / eager_logits.abs().max()).item()
    graphs = graphed.runner.prefill_graphs
    print(
        f"prefill graphs: {graphs.num_captures} captured, {graphs.num_replays} replays; "
        f"largest relative logit difference {worst:.2e}"
    )
    assert graphs.num_replays >= 4 and {size for size, _ in graphs.graphs} >= {64, 128, 512}
    assert worst <= 2e-3
    assert graph_tokens == eager_tokens
