// The short-sequence path of the CPU HSTU attention (forward and backward of one sequence of at most
// kShortMaxLen rows, all its heads). Included by attention.cpp inside its anonymous namespace, after
// the helpers it shares (row_span, table_bucket, fast_exp8); attention.cpp's
// item loops run a sequence here when short_path says so, and take their tile loops otherwise.
//
// Why a separate path: the GEM model's sequences are short (~36 rows, at most 74, H = 2, D = Dv = 16), so
// the general path's 128 x 128 tiles hand the BLAS products 36 x 36 x 16 shapes, where each sgemm
// call's fixed cost and a tile's full-width row passes outweigh the arithmetic. Here a sequence runs
// row by row on AVX2 over exactly the row's visible keys:
// - once per sequence, for every head: the mask, each row's span, and each pair's time bucket (they
//   depend on positions and timestamps only), the buckets from bucket_cells' table 4 pairs at a time
//   (the forward's 8 at a time on AVX-512F, bucket_row8);
// - per head, scores s[i, c] = q_i . k_c for the 8-column blocks that cover the row's span, from a
//   transposed copy of the head's keys (kt [D, Lp], Lp = L rounded up to 8): 4 blocks per pass;
// - scale, the head's position and time bias (by bucket), and the forward's SiLU, in one pass over
//   the same whole blocks (no scalar tail), from a padded copy of the head's pos_bias window; in the
//   backward the same pass gives P and dS (SiLU's derivative) without storing the biased scores. The
//   time bias and the bucket tables are read by scalar loads, not AVX2 gathers: on the Xeon this was
//   tuned on, a gather at the head of the exp / divide chain made that pass ~3x slower;
// - the products with V (forward), K, Q and dO (backward) run over the row's visible keys only
//   ([begin, end) less a prefix mask's hole), with the weights broadcast against rows of the other
//   operand: a masked pair is never multiplied, so an Inf or NaN in an invisible row never reaches
//   an output (the rule the general path keeps with masked_mm).
// - the backward's dk and dv (dk_c += ds[i, c] q_i, dv_c += p[i, c] dO_i) run after a head's rows, four
//   query rows at a time over the keys all four see, each row alone over the rest (a causal group's
//   last 1..3 keys, a target's own key): a row at a time they cost a load and a store of the dk and dv
//   rows per visible pair (~1/5 of the backward at the model's shape), four rows share one. On
//   AVX-512F with D and Dv multiples of 16 they run by 16-key blocks instead (key_block16, below).
// Where the CPU has AVX-512F (run-time check; GEM_KERNELS_NO_AVX512=1 keeps AVX2), the buckets take 8
// pairs at a time (bucket_row8), the forward's weights and P V 16 lanes, four rows a group, two heads at
// once (forward_rows16<2>), and so do the backward's P and dS (one head at a time; time bias from
// registers), dq and the dk / dv
// products (backward_rows16, scatter_rows16, scatter_rows4_16); the scores and dP stay dot_blocks
// (at D = Dv = 16, 16-key blocks: dot_key_block16, and dk / dv by key_block16; see below).
// Measured and not kept: each of the forward's phases (scores, weights, P V) over all of a head's rows
// before the next, so that the rows' exp chains overlap: slower than one pass per row (forward 2.8 vs
// 2.4 ms at the model's shape, 1 thread; on 8 lanes, phase by phase over four rows is what
// forward_rows16 does on 16).
// Work decomposition: one item = one sequence (its head-0 item of for_each_item; the other heads'
// items are empty); the backward's dk and dv rows accumulate in the workspace and are written once,
// its time-bias gradient in 4 interleaved histograms per head (two heads: 8 histograms of bucket
// pairs, filled after both heads' rows from their dS tiles, add_by_bucket8_pair).
// FLOPs and minimum bytes: the general path's (attention.cpp's header). At the model's call (B = 256,
// ~225k visible pairs a head, H = 2, D = Dv = 16) the backward is ~72 MFLOP and ~8 MB (q, k, v, dO
// read, dq, dk, dv written): ~4.1 ms on 1 thread is ~17 GFLOP/s, far from either roof.
// Where the backward's time goes at the model's call (1 thread, scripts/attention_model_call.py --native,
// 4.14 ms; perf samples of the kernel's functions, 2026-12-06): the row pass (bias and SiLU gradient,
// pos-bias gradient, the single-row dk/dv scatters, dk/dv write-out; inlined) ~1.95 ms, of which the
// SiLU gradient's exp and divide chain is the largest part; scores and dP (dot_blocks) 0.6; dk/dv
// four-row products (scatter_rows4) 0.5; buckets and spans (ShortSeq::init) 0.45; key and value
// transposes 0.27 (their samples sit on the first loads of the k and v rows); dq (gather_rows) 0.25;
// the time-bias histogram ~0.2 (0.43 before the pair histogram: skipping it measured -10 %).
// Measured and not kept (in-process A/B, 1 thread, at the model's call): the SiLU-gradient rows reading
// the time bias from registers on AVX-512F (TimeRegs, vpermt2ps; bias_silu_grad_row_tr per row) was
// 9-13 % slower, with or without the forward run in between; the histogram in 8 copies, not 4, no
// change (0.997x: the loop is bound by its instructions, not a copy's store-to-load chain); prefetching
// the next sequence's q, k, v, dO, dq, dk and dv rows (for_each_item looking one sequence ahead) 1.4 %
// slower; the scores and dP of a row in one pass (two rows against kt and vt, four FMA chains a block)
// 1.1 % slower.
// The backward on 16 lanes (backward_rows16 and the rest listed above), measured at the model's call (1
// thread, CPU time, 2026-12-06 ~17:25-17:30 UTC, the 2-core Xeon shared: load average ~3): against the
// build before (901c8aa: its backward rows 8-lane), 10 rounds of alternating processes
// (keep_freed_cpu_memory, 3 s each), the backward 4.04 -> 3.49 ms (median; per-round ratio median
// 0.861, range 0.80-0.99; min of mins 3.50 -> 3.14); scripts/attention_model_call.py --native, 3
// alternating rounds: bwd-op 4.02 / 4.00 / 4.17 -> 3.50 / 3.32 / 3.70 ms. The forward is unchanged
// (1.66 / 1.68 ms), and so is the GEM_KERNELS_NO_AVX512=1 backward (ratio 1.02 over 4 rounds: noise;
// its code is unchanged). Each piece by an in-process A/B of one build, variants by environment
// switches alternated per round (30-40 rounds x 20 calls; the switches are gone): the same backward
// with its rows on 8 lanes (bias_silu_grad_row's loop, gather_rows dq) was 1.117x the time (predicted
// ~8 % from the SiLU pass's instructions halved: ~3 -> ~2 blocks a row, 45 uops a block; the four-row
// group also overlaps the rows' exp / divide chains); in those rows the time bias by gather8, not
// TimeRegs, 1.048x (16 scalar loads and inserts a block against one vpermt2ps pair; per row on 8 lanes,
// above, TimeRegs was the slower); the dk / dv products on 8 lanes 1.037x; dq by 8-lane gather_rows
// 1.03x; the buckets by table_bucket4, not bucket_row8, 1.05-1.07x.
// Where the 16-lane backward's time goes now (perf samples of the kernel's functions, 1 thread, the
// same call, 2026-12-06 17:40 UTC; shares of the backward's samples): backward_rows16 21 % (P and dS,
// pos-bias gradient, inlined); the scores and dP (dot_blocks) 20 %; backward_seq_short 16 % (of it
// ~40 % the pair histogram, ~25 % the dk / dv write-out); the four-row dk / dv products
// (scatter_rows4_16) 9.5 %; the transposes 7.7 %; dq (gather_rows16) 6.5 %; the single-row products
// (scatter_rows16) 5.3 %; the buckets (bucket_row8) 4.9 %; masks and spans (SeqMask::init,
// ShortSeq::init) 4.2 %; memset (the dk / dv accumulators' fill) 2 %.
// Measured and not kept, in the same in-process A/B against the kept backward (the divide and the
// masked-block variants partly before its bucket_row8): the sigmoid's divide as rcp14 plus one Newton
// step (a blend keeps 1 / Inf = 0): 1.006x and 1.011x, no gain, as predicted from the counts: a 16-lane
// block is ~45 vector uops on 3 ports (~15 cycles), more than the zmm divide's ~10 cycles of divider a
// block; the same on the 8-lane rows (rcpps) no faster either (1.123x against 1.117x of the kept build
// without it); masked loads and stores for every block (no branch on a block's 8 or 16 width)
// 1.012-1.045x slower; the scores and dP on 16 lanes (dot16: zmm rows of kt and vt at stride Lp, masked
// for a last 8) 1.07-1.08x slower, as in the forward (a guess, not measured: zmm loads of rows at an Lp
// stride mostly split a cache line); every block 16 wide where the tile row has room (garbage past the
// span, never read) 1.03-1.07x slower; each group's dk / dv products right after its rows (interleaving
// the store-bound products with the rows' latency-bound chains) 0.993-0.998x: noise, not kept. Fewer
// wasted lanes (idea: exact spans, not 8-column blocks): with the last 16-lane block 8 or 16 wide,
// ceil(n / 16) = ceil(round8(n) / 16) blocks either way, so exact spans save no instruction in the P /
// dS pass, and dq and the products already run over the exact runs: not tried.
// Kept (2026-12-06 ~17:58-18:10 UTC, 1 thread, CPU time, scripts/attention_model_call.py --native in
// alternating processes against the build before (2c6b00a), 22 rounds, load average 2-3): the pair
// histogram in 8 copies at fixed pointers (add_by_bucket8_pair, ~6 instructions a key against ~10):
// the backward 3.31 -> 3.23 ms (medians; per-round ratio median 0.985, range 0.74-1.08, 14 of 22 rounds
// below 1; min of mins 3.03 -> 3.04), the forward unchanged (ratio 1.008). Predicted ~3 % (the
// histogram ~6 % of the backward, its instructions ~0.6x); measured ~1.5 %, near a round's noise.
// Measured and not kept (same method): the scores and dP on 16 lanes from a paired layout
// (transpose_rows storing rows d and d + 1 interleaved by 8-column blocks in a 64-byte-aligned buffer,
// one aligned zmm load a block for two d, against x[d] in lanes 0..7 and x[d + 1] in 8..15 by vpermps:
// half of dot_blocks' FMAs, no split loads), forward and backward: 14 rounds, backward ratio median
// 1.003, forward 0.993, no gain, though a zmm FMA measured 1.2x a ymm one's time in a standalone loop
// (0.53 against 0.44 ns: 1.6x the lanes a ns). So dot_blocks is not bound by its FMAs (a guess, not
// measured: the vpermps, 8 a row against ~2.75 blocks, share port 5 with the second FMA unit; or the
// latency of its short calls). The dk and dv rows accumulated in their output rows (stride qs, vs,
// zeroed there first), not in workspace rows copied out after each head: 6 rounds, backward ratio
// median 0.989 (0.72-1.03), noise, not kept. Not memory-bound: the backward per row at B = 8 (the
// inputs in L2) took 368 ns against 330 ns at the model's B = 256.
// Where the forward's time went (perf samples of the kernel's functions, 1 thread, the native forward
// at the model's call, 2026-12-06 19:50 UTC, build 3fcfb4a; shares of the forward's samples): the
// weights pass (forward_rows16's own: biases, exp, divide) 30 %; scores (dot_blocks) 20 %; P V
// (gather_rows16) 17 %; buckets (bucket_row8) 11 %; transposes 6 %; and ~17 % of per-sequence setup:
// ShortSeq::init 4.5 % (most of it at the return of its call to row_span per row), SeqMask::init 4.2 %
// (prefix_rows' binary search per row), the workspace's zero-fill ~3 % (for_each_item built ~300 KB of
// tiles per call), the pos-bias window's fill and copy per head (memset and memmove calls) and
// for_each_item's stable_sort of the 512 items ~2 % each. Kept (the setup, predicted ~11 % from those
// shares): prefix_rows by a forward-moving pointer, the prefix spans in one loop, the counting sort,
// the workspace kept per thread, pos_bias read in place (ShortSeq::pos_of); then dot_blocks and
// gather_rows16 inlined into the row loops (their prologues were ~1/5 of gather_rows16's samples;
// predicted ~4 %). Measured (1 thread, CPU time, native ops, keep_freed_cpu_memory, alternating
// processes, 2026-12-06 20:00-20:45 UTC, the 2-core Xeon shared, load average 1.5-3): the setup
// against 3fcfb4a, 6 rounds: forward 1.98 -> 1.84 ms (medians; per-round ratio median 0.934, range
// 0.84-0.96), backward ratio median 0.94 (0.89-1.00; it shares the setup); the inlining against that,
// 13 rounds: forward ratio median ~0.97, backward 0.98 (0.86-1.14: noise). scripts/attention_model_call.py
// (the autograd call), 3 alternating rounds against 3fcfb4a: fwd 2.58 / 2.50 / 2.32 -> 2.16 / 2.13 /
// 2.08 ms, fwd+bwd 8.60 / 7.66 / 7.13 -> 7.16 / 6.92 / 7.00 ms. All of it against 3fcfb4a (20:52-20:55
// UTC, 8 alternating rounds, load average ~3): forward 1.90 -> 1.71 ms (medians; per-round ratio median
// 0.91, range 0.80-0.97), backward 3.97 -> 3.75 ms (0.92, 0.90-1.00); GEM_KERNELS_NO_AVX512=1, 4 rounds:
// forward ratio median 0.96 (0.94-1.00), backward 0.96 (0.91-0.98). Where the forward's time goes now
// (perf, 20:57 UTC): forward_rows16 with the inlined scores and P V 63 %, dot_nb<2> and <3> (not
// inlined by gcc) 9 %, buckets 12 %, transposes 6 %, the setup left (for_each_item, ShortSeq::init,
// SeqMask::init, key_times' copy, prepare) ~10 %.
// Measured and not kept: the forward's SiLU divide x / (1 + e) as x * rcp14(1 + e) with one Newton step
// (a blend keeps 1 / Inf = 0), though ~27 % of forward_rows16's samples sat on the instruction after
// the divide: 5 alternating rounds, forward ratio median 1.07 (1.02-1.13) slower. So the divide is not
// what the pass waits on (the samples' skid lands on its consumer); as in the backward above.
//
// The backward by 16-key blocks where the CPU has AVX-512F (2026-12-06 night, helper attn8): at D and
// Dv multiples of 16, dk and dv (key_block16: a block's 16 keys in lanes, its 16 x 16 sums in 16
// registers over the rows that see it, one masked FMA a row and d, one in-register transpose and a
// direct write of the output rows), and at D = Dv = 16 the scores and dP too (dot_key_block16: the
// block's 16 key or value rows transposed into registers, 16 FMAs a row; no transposed copies of k
// and v). The rows of each block and the lanes each sees are listed once per sequence (KeyBlockRows),
// so neither loop branches on a row. The P / dS pass, the bias gradients and dq stay the row pass
// (backward_rows16); the 8-lane path (GEM_KERNELS_NO_AVX512=1) is unchanged. What a block costs: at
// the model's shape the blocks' rows hold ~1.32 lanes per visible pair (dot_blocks' 8-column blocks
// ~1.15), and here a zmm FMA took ~1.55x a ymm one's time (0.59-0.62 against 0.38-0.39 ns, 16
// independent chains in a standalone loop, the 2-core VM shared): the scores' FMA time is then only
// ~0.9x dot_blocks'; the rest of the gain is fewer loads, stores and loop ends (a guess, not measured:
// this VM has no PMU counters). Predicted from the perf shares before (dk / dv products, their fill and
// write-out ~22 % of the kernel; scores and dP ~22 %, transposes ~7 %): 6-12 % for dk / dv, ~8 % for
// the scores and dP.
// Measured (1 thread, CPU time, keep_freed_cpu_memory, native ops at the model's call, load average
// 1.3-3): in one process, variants by a temporary switch alternated per round (25 rounds x 30 calls):
// dk / dv by key blocks 0.928x the backward before (median of per-round ratios), with the scores and
// dP by key blocks too 0.828x (range 0.67-0.87); against the build before (12f4054) in alternating
// processes (scripts/attention_model_call.py --native, 6 rounds, 23:39-23:42 UTC, load average
// 2.0-2.6): backward 3.13 -> 2.62 ms (medians; per-round ratio median 0.844, range 0.82-0.89), forward
// 1.47 -> 1.46 ms (0.995: unchanged code); GEM_KERNELS_NO_AVX512=1, 4 rounds: backward 1.002, forward
// 0.996 (unchanged code). Where the backward's time goes now (perf samples of the kernel's functions,
// shares): backward_rows16 (P and dS, bias gradients, dq) 37 %, dot_key_block16 22 %, key_block16 16 %,
// backward_seq_short 13 % (of it ~1/2 the pair histogram, ~1/3 KeyBlockRows::init: its clamps and
// shifts per row and block; a cheaper build of the lists is a next small step), bucket_row8 7 %, mask
// and span setup 2 %.
// Measured and not kept (same in-process A/B, 20 rounds x 60 calls): the forward's scores by
// dot_key_block16 (a head's whole score tile before its rows, then forward_rows16 without dot_blocks
// and the key transpose): 1.007x the forward, no gain (a guess, not measured: the forward's groups of
// four rows overlap their scores with the previous rows' exp / divide chains, which a separate pass
// over the tile gives up, and the forward builds KeyBlockRows for one use per head).
//
// KeyBlockRows built 16 rows at a time on AVX-512F (helper attn9, 2026-12-07): each row's runs once as
// 32-bit columns, a block's lanes for 16 rows by clamps and vpsllvd, the listed rows and masks by
// vpcompressd (a row and block at a time its clamps and shifts were ~1/3 of backward_seq_short's
// samples, ~4 % of the backward). Predicted ~3 %. Measured (1 thread, CPU time, --native, alternating
// processes against 83ad6c7, 4 rounds, load average 1-2): backward ratio per round 0.974 / 0.955 /
// 0.996 / 1.005 (2.74 -> 2.69 ms, medians); perf shares of the kernel's samples: backward_seq_short
// 12.5 -> 8.6 %, KeyBlockRows::init 1.4 %.
// Measured and not kept (same method, against that build, 7 rounds, load average ~1): the P / dS steps
// folded into the dP key blocks (dot_key_block16 going on from each row's dP block to its P and dS, the
// row pass keeping the bias gradients and dq; time bias from TimeRegs): backward ratio per round 1.04 /
// 1.04 / 0.97 / 1.07 / 1.15 / 1.08 / 1.02, slower. A guess, not measured: a block's rows compute all 16
// lanes (~1.32 lanes a visible pair against the row pass's ~1.15), and the exp / divide steps a lane
// cost more than the FMAs the fold overlaps them with.
// bucket_row8 by one gather (helper attn9): cell_bucket and cell_next packed in one 64-bit table entry
// (Params::cell_packed), one vpgatherqq of 8 a block, not a vpgatherqd and a vpgatherqq. Predicted
// from bucket_row8's shares (12 % of the forward, 7 % of the backward): ~3.5 % forward, ~2 % backward.
// Measured (1 thread, CPU time, --native, alternating processes, 2026-12-07 00:17-00:25 UTC, load average
// ~1): against the KeyBlockRows build above, 9 rounds: forward ratio median ~0.955 (0.90-1.06), backward
// ~0.965 (0.94-1.01). Both changes against 83ad6c7, 5 rounds: forward 1.50 -> 1.48 ms (medians;
// per-round ratio median 0.975, 0.91-1.10), backward 2.84 -> 2.71 ms (0.965, 0.94-1.01);
// GEM_KERNELS_NO_AVX512=1 (its code unchanged but the table's fill per call), 3 rounds: forward 0.98,
// backward 1.03 (0.97-1.06): noise.//
// Heads in pairs in the forward (helper short10, 2026-12-07): forward_rows16<2> runs the four-row
// groups of two heads at once (H even; an odd last head alone, forward_rows16<1>): one span, lo / hi
// and block-mask step per row for both heads, one load of a block's buckets feeding both heads'
// vpermt2ps, the two heads' exp / divide chains in one loop; both heads' keys by one transpose of 2D
// columns; the pos_bias window in two copies (ShortSeq::pos_window[h % 2]). Counted at the model's
// call before it: a (pair, head) took ~3.1 ns (~8 cycles at the 2.6 GHz TSC; 1.5 ms for 480k) against
// ~7 vector uops from its instructions (scores ~2.2 with 8-lane FMAs, weights ~1.4, P V 2, times
// ~1.2 lanes a visible pair), ~1.8 cycles at 4 a cycle; per row and head that is ~210 cycles for ~25
// visible pairs, so most of the time is per row, not per pair (a guess, not measured: this VM has no
// PMU counters to count the loops' branch misses). perf shares of the forward's kernel samples then
// (1 thread): forward_rows16 65 % (the scores and P V inlined; ~13 % of its samples on the multiply
// after the divide), bucket_row8 10 %, dot_nb<2> / <3> 8.7 %, transposes 7 %, for_each_item 3 %,
// ShortSeq::init 1.7 %, SeqMask::init 1.7 %. Predicted ~8-10 % of the forward (the per-row steps
// shared, two chains to overlap). Measured (1 thread, CPU time, native forward, alternating processes
// of one build with a temporary switch that ran the heads one at a time, 19 rounds, 05:35-05:56 UTC,
// load average 3-5.6): forward ratio median 0.917 (range 0.83-1.19, 15 of 19 below 1); medians of 13
// rounds 1.69 -> 1.51 ms; against main (b99dc98), 8 alternating rounds: forward ratio median 0.938
// (0.84-1.05), 1.57 -> 1.49 ms, backward 1.012 (unchanged code: noise); at 2 threads (wall, under
// the measuring lock and SCHED_FIFO, 3 rounds) the native forward 0.99 / 0.92 / 0.95
// (bench/results/notes-short10.md). The backward's rows in pairs the same way (backward_rows16<2>: s, P and dS
// tiles of both heads side by side, dk / dv by key_blocks16 after the pair; where dk and dv take key
// blocks), predicted ~4 % (the row pass ~37 % of the backward): 13 rounds, backward ratio median 0.968
// (0.74-1.20; min of mins 2.68 -> 2.74 ms), noise, not kept (a guess, not measured: two heads' s, P
// and dS tiles, ~47 KB at L = 74, no longer fit the 48 KB L1 beside the buckets; and its four-row
// groups already overlap the chains that pairing adds).
// Measured and not kept (after the pairs, same method against the kept build, 8 rounds, load average
// ~2.8): dot_nb always inlined (gcc leaves dot_nb<2> and <3> out of line: 8.7 % of the forward's
// samples; predicted ~1.5 %, their calls' fixed part): forward ratio median 0.991 (0.92-1.05), noise.
// Counted against the vector ports (helper short11, 2026-12-07): a standalone loop of 12 independent FMA
// chains on this shared VM took 0.54 ns a zmm FMA and 0.36 ns a ymm one (an add chain: ~4 GHz; a guess, not
// measured: the other vCPU shares the core), so a zmm op is ~2 cycles here, not 0.5. The backward's vector
// ops at the model's call (per head 240k visible pairs, 19.7k key-block rows at ~1.32 lanes a pair, 19.7k
// 16-lane row blocks): 64 FMAs and 3 adds a key-block row (scores, dP, dk, dv), ~33 ops a row block (bias,
// exp, divide, P, dS), one FMA a pair for dq: ~4.3M zmm ops, ~2.3 ms at 0.54 ns, against 2.3-2.5 ms
// measured. So the ops, not a per-row fixed cost, may be most of the time; but not all (fewer adds in
// dot_key_block16, below, did not pay). perf shares of the backward's kernel samples then (1 thread):
// backward_rows16 39 % (~28 % of it dq, ~60 % the P / dS pass), dot_key_block16 24 % (a quarter on the
// first loads of the block's key rows), key_block16 16.5 %, backward_seq_short 9.3 % (the pair histogram,
// its copy pointers reloaded from the stack), bucket_row8 5.8 %, KeyBlockRows::init, ShortSeq::init and
// SeqMask::init 3.7 %.
// Kept: (1) the 16-lane SiLU rows of both passes take exp16_neg (15 vector ops against fast_exp16's 20 and
// the negation; outputs bit for bit as before). Predicted, were the passes bound by their ops: ~6 % of the
// forward (its weights pass ~30 % of the samples, 6 ops of ~31 a block) and ~4 % of the backward.
// (2) the backward's dq in four registers over both runs of a row, written once (no memset call, no reload
// between the runs and for the scale; one sum, not two); dq's rounding changes (other sums, same terms),
// bit-identical run to run. Predicted ~2-3 % of the backward (dq ~11 % of its samples, ~20 of its ~60
// instructions a row gone). Measured (1 thread, CPU time, native ops, one process, the variants by a
// temporary switch alternated per round, 16 and 20 rounds x 25 calls, 08:35-08:38 UTC, load average 3-4.6):
// (1) forward ratio median 0.964 / 0.961 (15-19 of 16-20 rounds below 1), backward 0.980 / 0.978; (2)
// backward 0.960 / 0.960; both (20 rounds) backward 0.943. Against main (a1e08e8) in alternating processes,
// 10 rounds (08:39-08:43 UTC, load average ~3): forward 1.265 -> 1.194 ms (medians; per-round ratio median
// 0.953, range 0.88-0.99, 10 of 10 below 1), backward 2.407 -> 2.284 ms (0.940, 0.87-0.97, 10 of 10); 2
// threads, wall, under the measuring lock and SCHED_FIFO, 6 rounds: forward 0.700 -> 0.697 ms (0.979,
// 0.94-1.01), backward 1.403 -> 1.292 ms (0.947, 0.87-0.99, 6 of 6). The AVX2 rows
// (GEM_KERNELS_NO_AVX512=1) are unchanged.
// Measured and not kept (same in-process A/B): dot_key_block16 in 2 FMA chains a row (one add, not 3)
// backward 1.002, in 1 chain (no add: a 16-FMA chain) 1.023, slower: the adds were not what it waited on;
// the scale and pos bias by one FMA and inv_m folded into the sigmoid (P = x * (sig * inv_m), g with one
// FMA: 3 ops fewer a block, rounding changed) on top of (1): backward 0.972 / 0.973 against 0.980 / 0.978,
// and with (2) 0.942 / 0.936 against 0.943, under the rounds' spread; the forward's P V over both runs in
// registers, as dq in (2): forward 0.990 (0.91-1.06), noise.
//
// Where the time goes, by knockouts (helper short14, 2026-12-07 16:20 UTC; the model's call, native ops,
// 1 thread, CPU time; one build with a temporary switch that skipped one phase at a time, outputs wrong
// and only timed, alternated per round in one process, 8 rounds x 20 calls, load average 2.7-3.2). The
// forward (1.51-1.55 ms) ran 0.736x without its scores (dot_blocks), 0.824x without P V, 0.829x without
// the weights pass, 0.913x without only that pass's exp and divide, 0.913x without the buckets
// (bucket_row8) and 0.933x without the key transposes. With all of these skipped it ran 0.27x: ~0.42 ms is
// per-call, per-sequence and per-row setup and loop control. The backward (2.68-3.03 ms) ran 0.837x
// without the scores and dP (dot_key_block16), 0.823x without dk and dv (key_blocks16), 0.861x without
// the P / dS pass, 0.994x without only its exp and divide, 0.910x without dq, 0.931x without the pair
// histogram, 0.952x without the buckets and 0.966x without the position gradient. With all of these
// skipped it ran 0.205x (~0.62 ms left). So the SiLU's exp and divide are ~9 % of the forward and nothing
// of the backward: they overlap the products' FMAs. That is why removing vector ops from them paid a
// third of the op counts' prediction or less (exp16_neg above; the polynomial below). What costs is the
// products (scores and P V ~44 % of the forward; scores, dP, dk, dv and dq ~52 % of the backward), and
// the skeleton.
// Kept (helper short14): (1) a time table of exactly 33 entries (the model's 32 buckets): entries 0..31 by
// one vpermt2ps from two registers, entry 32 from a broadcast under a compare's mask (TimeRegs regs = 3,
// time_of_buckets). That is 3 vector ops a block and head where the four-register form took 4, and the
// forward's head pairs share the compare. Bits are unchanged. Predicted ~1.5 % of the forward and ~1 % of
// the backward. Measured (in-process switch, 20 rounds x 30 calls, 1 thread, load ~3): forward 1.001
// (noise), backward 0.989 (15 of 20 rounds below 1).
// (2) The time buckets kept from call to call (BucketCache, below): the model's four calls a step (two
// layers, forward and backward) take the same timestamps, so the first forward finds the buckets and the
// other three read them back, a uint8 a pair. Predicted from the knockouts: the other forward ~-8 %, each
// backward ~-4 %, the first forward a little slower (the key copy and the uint8 stores). Measured
// (in-process switch, a model-like step of fwd, fwd, bwd, bwd on one batch with two batches alternating,
// 12 rounds x 10 steps, load 3.4-4.8):
// - 1 thread, CPU time: first forward 1.022, second 0.913, backwards 0.980 and 0.954; the step 8.43 -> 8.25
//   ms (0.967, 10 of 12 rounds below 1).
// - 2 threads, wall, under the measuring lock and SCHED_FIFO: 1.036, 0.960, 0.967 and 0.960; the step
//   4.52 -> 4.40 ms (0.971, 11 of 12).
// Measured and not kept (same switch, 12 rounds x 30 calls, 1 thread): exp16_neg with a degree-6 minimax
// polynomial (7 terms, one FMA fewer than the degree-7 Taylor; max error on [-ln2/2, ln2/2] 0.88 ulp
// against 0.76): forward 0.986, backward 0.981 at 1 thread. With (1) at 2 threads under the lock it gave
// 0.993 / 1.004. It changes the SiLU's bits for a gain inside the noise.
// Not tried, with estimates from the knockouts:
// - the forward's biased scores (4 bytes a pair and head, ~2.5 MB a call) saved for the backward: no
//   scores or bias recomputed there (~0.2 of the backward), against writing and reading them back and a
//   new saved output in the op's schema, on every backend;
// - pairing two rows' 8-wide last blocks in one zmm of the weights pass: the pass is ~17 % of the forward
//   and its exp and divide overlap the products, so <~2 %.
// Taken when: kind hstu, the full forward (no cached delta rows), D and Dv multiples of 8, L <=
// kShortMaxLen, and a banded or prefix mask (every row's visible keys are one run, less at most one
// hole; the other masks ask visible() per pair and take the tile loops). Needs AVX2 (the build's
// default); other builds always take the tile loops.

// At most one 128-row tile, so the workspace's tiles hold the whole item.
constexpr int64_t kShortMaxLen = kBlockN;

// One sequence's time buckets kept between calls (BucketCache): rows[i * Lp + c] the bucket of pair (i, c)
// over the 8-column blocks of row i's span. hit: rows holds them (read them); else, rows non-null:
// write them there as they are found; null: nothing kept.
struct CachedBuckets {
  uint8_t* rows = nullptr;
  bool hit = false;
};

// The short path's time buckets of every pair, kept from one call to the next. They depend on the
// timestamps, the sequences and the mask options only (not on q, k, v or the bias values), so the GEM
// model's HSTU layers, which all take the same timestamps, find them once per step: the first layer's
// forward writes them, the other layers' forwards and every backward read them (a uint8 a pair: ~0.4 MB
// at the model's call) instead of finding them again (bucket_row8: ~9 % of the forward, ~5 % of the
// backward there). A call uses the kept buckets only when every input they depend on equals the one
// they were found from, compared element by element (the timestamps' copies included: no pointer, version or hash
// is trusted), so the outputs are exactly those of a call that finds them itself. One cache per process, the last
// call's; a call that misses builds its own and publishes it when done (a concurrent call keeps the one it
// took: shared_ptr).
struct BucketCache {
  int64_t num_buckets = 0, contextual_len = 0, max_attn_len = 0;
  bool causal = false, has_query_timestamps = false;
  std::vector<SeqInfo> seqs;
  std::vector<int64_t> timestamps, query_timestamps;
  std::vector<int64_t> offset;  // sequence b's rows at offset[b], -1: none (not on the short path)
  std::unique_ptr<uint8_t[]> rows;

  bool matches(const Prepared& in) const {
    const Params& p = in.p;
    const bool has_qt = in.query_timestamps.defined();
    if (num_buckets != p.num_buckets || contextual_len != p.contextual_len || max_attn_len != p.max_attn_len ||
        causal != p.causal || has_query_timestamps != has_qt || seqs.size() != in.seqs.size() ||
        static_cast<int64_t>(timestamps.size()) != in.timestamps.numel())
      return false;
    for (size_t b = 0; b < seqs.size(); ++b)
      if (seqs[b].start != in.seqs[b].start || seqs[b].len != in.seqs[b].len || seqs[b].targets != in.seqs[b].targets)
        return false;
    const size_t n = timestamps.size() * sizeof(int64_t);
    if (std::memcmp(timestamps.data(), in.timestamps.const_data_ptr<int64_t>(), n) != 0) return false;
    return !has_qt || (static_cast<int64_t>(query_timestamps.size()) == in.query_timestamps.numel() &&
                       std::memcmp(query_timestamps.data(), in.query_timestamps.const_data_ptr<int64_t>(),
                                   query_timestamps.size() * sizeof(int64_t)) == 0);
  }

  CachedBuckets of(int64_t b, bool hit) const {
    return offset[b] < 0 ? CachedBuckets{} : CachedBuckets{rows.get() + offset[b], hit};
  }
};

bool short_path(const Prepared& in, const SeqInfo& seq);

// The kept buckets for this call (hit) or a new, empty cache to fill (published by publish_buckets after
// the call's items); null without a time bias, or with more than 256 buckets (a uint8 a pair).
struct BucketPlan {
  std::shared_ptr<BucketCache> cache;
  bool hit = false;
  CachedBuckets of(int64_t b) const { return cache != nullptr ? cache->of(b, hit) : CachedBuckets{}; }
};

std::mutex bucket_cache_mutex;
std::shared_ptr<BucketCache> bucket_cache;  // guarded by bucket_cache_mutex

BucketPlan bucket_plan(const Prepared& in) {
  const Params& p = in.p;
  if (p.time_bias == nullptr || p.num_buckets > 255) return {};
  BucketPlan plan;
  {
    std::lock_guard<std::mutex> lock(bucket_cache_mutex);
    plan.cache = bucket_cache;
  }
  if (plan.cache != nullptr && plan.cache->matches(in)) {
    plan.hit = true;
    return plan;
  }
  auto c = std::make_shared<BucketCache>();
  c->num_buckets = p.num_buckets;
  c->contextual_len = p.contextual_len;
  c->max_attn_len = p.max_attn_len;
  c->causal = p.causal;
  c->seqs = in.seqs;
  const int64_t* t = in.timestamps.const_data_ptr<int64_t>();
  c->timestamps.assign(t, t + in.timestamps.numel());
  c->has_query_timestamps = in.query_timestamps.defined();
  if (c->has_query_timestamps) {
    const int64_t* qt = in.query_timestamps.const_data_ptr<int64_t>();
    c->query_timestamps.assign(qt, qt + in.query_timestamps.numel());
  }
  c->offset.resize(in.seqs.size());
  int64_t total = 0;
  for (size_t b = 0; b < in.seqs.size(); ++b) {
    const SeqInfo& seq = in.seqs[b];
    const bool kept = seq.len > 0 && short_path(in, seq);
    c->offset[b] = kept ? total : -1;
    if (kept) total += seq.len * ((seq.len + 7) & ~int64_t{7});
  }
  c->rows.reset(new uint8_t[std::max<int64_t>(total, 1)]);  // every read row block is written first
  plan.cache = std::move(c);
  return plan;
}

// After a call's items: its new cache replaces the kept one.
void publish_buckets(const BucketPlan& plan) {
  if (plan.cache == nullptr || plan.hit) return;
  std::lock_guard<std::mutex> lock(bucket_cache_mutex);
  bucket_cache = plan.cache;
}

#if GK_ATTENTION_AVX2

inline int64_t round8(int64_t n) { return (n + 7) & ~int64_t{7}; }

// dst[d * Lp + j] = rows[j * ld + d] for j < L, 0 for L <= j < Lp (padding columns stay finite);
// width a multiple of 8. By 8 x 8 blocks in registers: an element-wise copy with a strided store
// was ~13 % of the forward.
void transpose_rows(const float* rows, int64_t ld, int64_t L, int64_t width, float* dst) {
  const int64_t Lp = round8(L);
  for (int64_t j0 = 0; j0 < Lp; j0 += 8)
    for (int64_t d0 = 0; d0 < width; d0 += 8) {
      __m256 r[8];
      for (int64_t k = 0; k < 8; ++k)
        r[k] = j0 + k < L ? _mm256_loadu_ps(rows + (j0 + k) * ld + d0) : _mm256_setzero_ps();
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = dst + d0 * Lp + j0;
      _mm256_storeu_ps(o + 0 * Lp, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * Lp, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * Lp, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * Lp, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * Lp, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * Lp, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * Lp, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * Lp, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
}

// out[8k, 8k + 8) = sum_d x[d] * t[d * ld + 8k, + 8) for k < NB: two FMA chains per block (even
// and odd d; width is even), so even one block is not bound by the FMA latency.
template <int NB>
inline void dot_nb(const float* x, int64_t width, const float* t, int64_t ld, float* out) {
  __m256 a[NB], b[NB];
  for (int k = 0; k < NB; ++k) a[k] = b[k] = _mm256_setzero_ps();
  for (int64_t d = 0; d < width; d += 2) {
    const __m256 x0 = _mm256_set1_ps(x[d]), x1 = _mm256_set1_ps(x[d + 1]);
    const float* r0 = t + d * ld;
    const float* r1 = r0 + ld;
    for (int k = 0; k < NB; ++k) {
      a[k] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(r0 + 8 * k), a[k]);
      b[k] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(r1 + 8 * k), b[k]);
    }
  }
  for (int k = 0; k < NB; ++k) _mm256_storeu_ps(out + 8 * k, _mm256_add_ps(a[k], b[k]));
}

// out[c] = sum_d x[d] * t[d * ld + c] for c in the 8-column blocks [b0, b1).
__attribute__((always_inline)) inline void dot_blocks(const float* x, int64_t width, const float* t, int64_t ld,
                                                     int64_t b0, int64_t b1, float* out) {
  int64_t b = b0;
  for (; b + 4 <= b1; b += 4) dot_nb<4>(x, width, t + 8 * b, ld, out + 8 * b);
  switch (b1 - b) {
    case 3: dot_nb<3>(x, width, t + 8 * b, ld, out + 8 * b); break;
    case 2: dot_nb<2>(x, width, t + 8 * b, ld, out + 8 * b); break;
    case 1: dot_nb<1>(x, width, t + 8 * b, ld, out + 8 * b); break;
    default: break;
  }
}

// acc[0, width) += sum_{c in [c0, c1)} w[c] * x[c * ldx + (0, width)] (width a multiple of 8).
void gather_rows(const float* w, const float* x, int64_t ldx, int64_t c0, int64_t c1, int64_t width, float* acc) {
  int64_t d = 0;
  for (; d + 16 <= width; d += 16) {
    // Four keys per step into separate accumulators (8 FMA chains): throughput-, not latency-bound.
    __m256 a[8];
    a[0] = _mm256_loadu_ps(acc + d);
    a[1] = _mm256_loadu_ps(acc + d + 8);
    for (int k = 2; k < 8; ++k) a[k] = _mm256_setzero_ps();
    int64_t c = c0;
    for (; c + 4 <= c1; c += 4)
      for (int k = 0; k < 4; ++k) {
        const __m256 wk = _mm256_set1_ps(w[c + k]);
        const float* xk = x + (c + k) * ldx + d;
        a[2 * k] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(xk), a[2 * k]);
        a[2 * k + 1] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(xk + 8), a[2 * k + 1]);
      }
    for (int k = 0; c < c1; ++c, ++k) {
      const __m256 wk = _mm256_set1_ps(w[c]);
      a[2 * k] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + c * ldx + d), a[2 * k]);
      a[2 * k + 1] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + c * ldx + d + 8), a[2 * k + 1]);
    }
    _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[4], a[6])));
    _mm256_storeu_ps(acc + d + 8, _mm256_add_ps(_mm256_add_ps(a[1], a[3]), _mm256_add_ps(a[5], a[7])));
  }
  if (d < width) {  // one 8-wide chunk left
    __m256 a = _mm256_loadu_ps(acc + d);
    for (int64_t c = c0; c < c1; ++c) a = _mm256_fmadd_ps(_mm256_set1_ps(w[c]), _mm256_loadu_ps(x + c * ldx + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
}

// out[c * width + (0, width)] += alpha * w[c] * x[(0, width)] for c in [c0, c1) (width a multiple of 8).
void scatter_rows(const float* w, float alpha, const float* x, int64_t c0, int64_t c1, int64_t width, float* out) {
  for (int64_t d = 0; d < width; d += 8) {
    const __m256 xd = _mm256_mul_ps(_mm256_set1_ps(alpha), _mm256_loadu_ps(x + d));
    for (int64_t c = c0; c < c1; ++c) {
      float* o = out + c * width + d;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(w[c]), xd, _mm256_loadu_ps(o)));
    }
  }
}

// out[c * width + (0, width)] += alpha * sum_{k < 4} w[k * ldw + c] * x[k * ldx + (0, width)] for c in
// [c0, c1) (width a multiple of 8): scatter_rows for four rows that all see the keys [c0, c1). One load
// and one store of each out row per four rows (scatter_rows is bound by them: one each per row and
// key), and each x chunk held in registers for the whole run of keys.
void scatter_rows4(const float* w, int64_t ldw, float alpha, const float* x, int64_t ldx, int64_t c0, int64_t c1,
                   int64_t width, float* out) {
  const __m256 va = _mm256_set1_ps(alpha);
  for (int64_t d = 0; d < width; d += 8) {
    const __m256 x0 = _mm256_mul_ps(va, _mm256_loadu_ps(x + d)), x1 = _mm256_mul_ps(va, _mm256_loadu_ps(x + ldx + d));
    const __m256 x2 = _mm256_mul_ps(va, _mm256_loadu_ps(x + 2 * ldx + d));
    const __m256 x3 = _mm256_mul_ps(va, _mm256_loadu_ps(x + 3 * ldx + d));
    for (int64_t c = c0; c < c1; ++c) {
      float* o = out + c * width + d;
      // Two chains, summed: (o + w0 x0 + w1 x1) + (w2 x2 + w3 x3).
      const __m256 a = _mm256_fmadd_ps(_mm256_set1_ps(w[ldw + c]), x1,
                                       _mm256_fmadd_ps(_mm256_set1_ps(w[c]), x0, _mm256_loadu_ps(o)));
      const __m256 b = _mm256_fmadd_ps(_mm256_set1_ps(w[3 * ldw + c]), x3, _mm256_mul_ps(_mm256_set1_ps(w[2 * ldw + c]), x2));
      _mm256_storeu_ps(o, _mm256_add_ps(a, b));
    }
  }
}

// dst[0, n) = src[0, n), and = 0, for n a multiple of 8: the per-row copies and fills of D or Dv floats
// otherwise call memmove / memset (~3 % of the backward at the model's shape, D = 16).
inline void copy_row8(const float* src, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; d += 8) _mm256_storeu_ps(dst + d, _mm256_loadu_ps(src + d));
}
inline void zero_row8(float* dst, int64_t n) {
  for (int64_t d = 0; d < n; d += 8) _mm256_storeu_ps(dst + d, _mm256_setzero_ps());
}

// The visible keys of row i as at most two runs [a0, a1) and [b0, b1): the span less its hole.
struct Runs {
  int64_t a0, a1, b0, b1;
};

inline Runs runs_of(const RowSpan& span) {
  if (span.hole_end > span.hole_begin) return {span.begin, span.hole_begin, span.hole_end, span.end};
  return {span.begin, span.end, span.end, span.end};
}

// bucket[c] = table_bucket(ti - tk[c]) for c in [c0, c1) (multiples of 8), ShortSeq::table_bucket4's
// steps on 8 lanes of AVX-512F (run where the CPU has it), the two tables read by one gather of their
// packed entries (Params::cell_packed): here no chain waits on it (see gather8 for where one does). A block with a lane out of the table's range
// takes table_bucket lane by lane.
GK_AVX512 void bucket_row8(const Params& p, int64_t ti, const int64_t* tk, int64_t c0, int64_t c1, int32_t* bucket) {
  const __m512i vti = _mm512_set1_epi64(ti), one = _mm512_set1_epi64(1), zero = _mm512_setzero_si512();
  const __m512i limit = _mm512_set1_epi64((int64_t{1} << 52) - 1), two52 = _mm512_set1_epi64(int64_t{0x4330000000000000});
  for (int64_t c = c0; c < c1; c += 8) {
    // |INT64_MIN| stays negative: out of range too.
    const __m512i x = _mm512_abs_epi64(_mm512_sub_epi64(vti, _mm512_loadu_si512(tk + c)));
    bool ok = (_mm512_cmplt_epi64_mask(x, zero) | _mm512_cmpgt_epi64_mask(x, limit)) == 0;
    if (ok) {
      const __m512i x1 = _mm512_max_epi64(x, one);  // x = 0 shares cell 0 with 1
      const __m512d xd = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_or_si512(x1, two52)), _mm512_castsi512_pd(two52));
      const __m512i cell = _mm512_sub_epi64(_mm512_srli_epi64(_mm512_castpd_si512(xd), 48), _mm512_set1_epi64(0x3FF0));
      const __m512i packed = _mm512_i64gather_epi64(cell, reinterpret_cast<const long long*>(p.cell_packed.data()), 8);
      ok = _mm512_cmplt_epi64_mask(packed, zero) == 0;  // no cell that needs the search
      if (ok) {
        const __m512i next = _mm512_and_si512(packed, limit);
        const __m512i b = _mm512_mask_add_epi64(_mm512_srli_epi64(packed, 52), _mm512_cmpgt_epi64_mask(x, next),
                                                _mm512_srli_epi64(packed, 52), one);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(bucket + c), _mm512_cvtepi64_epi32(b));
      }
    }
    if (!ok)
      for (int64_t k = c; k < c + 8; ++k) bucket[k] = table_bucket(p, ti - tk[k]);
  }
}

// What a sequence's heads share, laid out for whole 8-column blocks (the columns past a row's span
// included): every row's span, and every pair's time bucket (in the workspace's bucket tile, row i at
// i * Lp: see backward_seq_short for why not kBlockN) from key timestamps padded to Lp with the last one. The bucket of a pair depends on
// its timestamps only, so it is found once for all heads, and read back from the call's BucketCache
// where an earlier call found it (CachedBuckets). Per thread, reused.
struct ShortSeq {
  std::vector<RowSpan> spans;
  std::vector<int64_t> key_times;
  std::vector<float> pos_window[2];  // a head's: pos[c - i + L - 1] = pos_bias[h, c - i + M - 1]; 0 past 2L - 2
  std::vector<float> hist;        // the backward's time-bias gradient: 4 copies (H = 2: 8 copies of pairs)

  // wide_buckets: bucket_row8 (AVX-512F), else table_bucket4. The forward takes bucket_row8 (with its
  // 16-lane rows: ~2.0 -> ~1.7 ms at the model's shape, 1 thread), and so does the backward with its
  // 16-lane rows (backward_rows16: 5-7 % faster than table_bucket4, in-process A/B, 40 rounds); with
  // its 8-lane rows it measured ~3 % slower than table_bucket4 (4.30 against 4.18 ms).
  void init(const Params& p, const SeqInfo& seq, Workspace& ws, bool wide_buckets, const CachedBuckets& cached) {
    const int64_t L = seq.len, Lp = round8(L);
    ws.mask.init(p, L, seq.targets);
    const int tile_kind = ws.mask.classify(0, L, 0, L);
    spans.resize(L);
    if (ws.mask.prefix && tile_kind != 2) {
      // row_span's prefix case at j0 = 0, bn = L, in one loop, not a call per row (see the header).
      const int64_t* pe = ws.mask.prefix_end.data();
      RowSpan* out = spans.data();
      for (int64_t i = 0; i < L; ++i) {
        const int64_t hi = pe[i];
        out[i] = {0, i >= hi ? i + 1 : hi, hi, i > hi ? i : hi, false};
      }
    } else {
      for (int64_t i = 0; i < L; ++i) spans[i] = row_span(ws.mask, tile_kind, i, 0, L);
    }
    if (p.time_bias == nullptr) return;
    const int64_t* t = p.timestamps + seq.start;
    key_times.assign(t, t + L);
    key_times.resize(Lp, t[L - 1]);
    // Locals, not members: short_seq is thread_local, and gcc re-derived its address (a call, with
    // vzeroupper and spills) on every 4 keys to reread key_times.
    const int64_t* tk = key_times.data();
    const RowSpan* sp = spans.data();
    for (int64_t i = 0; i < L; ++i) {
      const RowSpan& span = sp[i];
      if (span.end <= span.begin) continue;
      const int64_t ti = p.query_timestamps[seq.start + i];
      int32_t* bucket = ws.bucket.data() + i * Lp;
      const int64_t c0 = span.begin & ~int64_t{7}, c1 = round8(span.end);
      if (cached.hit) {
        widen_buckets(cached.rows + i * Lp, c0, c1, bucket);
        continue;
      }
      if (wide_buckets) {
        bucket_row8(p, ti, tk, c0, c1, bucket);
      } else {
        for (int64_t c = c0; c < c1; c += 4) {
          if (!table_bucket4(p, ti, tk + c, bucket + c))
            for (int64_t k = c; k < c + 4; ++k) bucket[k] = table_bucket(p, ti - tk[k]);
        }
      }
      if (cached.rows != nullptr) narrow_buckets(bucket, c0, c1, cached.rows + i * Lp);
    }
  }

  // dst[c] = src[c] for c in [c0, c1) (multiples of 8): a cached row's buckets into the bucket tile.
  static void widen_buckets(const uint8_t* src, int64_t c0, int64_t c1, int32_t* dst) {
    for (int64_t c = c0; c < c1; c += 8)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + c))));
  }
  // dst[c] = src[c] (each in [0, 255]) for c in [c0, c1) (multiples of 8): the tile's buckets into the cache.
  static void narrow_buckets(const int32_t* src, int64_t c0, int64_t c1, uint8_t* dst) {
    for (int64_t c = c0; c < c1; c += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
      const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + c), _mm_packus_epi16(w, w));
    }
  }

  // table_bucket of ti - tk[0, 4) on 4 lanes, into out[0, 4); false (nothing written) when a lane's
  // |dt| is 2^52 or more or falls in a cell that needs the search. |dt| < 2^52 converts to a double
  // exactly, and the double's exponent and first 4 mantissa bits are bucket_cell's e * 16 + m.
  static bool table_bucket4(const Params& p, int64_t ti, const int64_t* tk, int32_t* out) {
    const __m256i d = _mm256_sub_epi64(_mm256_set1_epi64x(ti), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tk)));
    const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi64x(1);
    const __m256i x = _mm256_blendv_epi8(d, _mm256_sub_epi64(zero, d), _mm256_cmpgt_epi64(zero, d));
    // |INT64_MIN| wraps to a negative x: out of range too.
    const __m256i out_of_range = _mm256_or_si256(_mm256_cmpgt_epi64(zero, x),
                                                 _mm256_cmpgt_epi64(x, _mm256_set1_epi64x((int64_t{1} << 52) - 1)));
    if (!_mm256_testz_si256(out_of_range, out_of_range)) return false;
    const __m256i x1 = _mm256_blendv_epi8(x, one, _mm256_cmpgt_epi64(one, x));  // x = 0 shares cell 0 with 1
    const __m256i two52 = _mm256_set1_epi64x(int64_t{0x4330000000000000});
    const __m256d xd = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(x1, two52)), _mm256_castsi256_pd(two52));
    const __m256i cell = _mm256_sub_epi64(_mm256_srli_epi64(_mm256_castpd_si256(xd), 48), _mm256_set1_epi64x(0x3FF0));
    // The tables by scalar loads, not vpgatherqd / vpgatherqq, as in gather8 (here no difference
    // showed at the model's shape: the pass is ~0.4 ms of the forward either way).
    alignas(32) int64_t cs[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(cs), cell);
    const int32_t* cb = p.cell_bucket.data();
    const __m128i b = _mm_setr_epi32(cb[cs[0]], cb[cs[1]], cb[cs[2]], cb[cs[3]]);
    if (_mm_movemask_epi8(_mm_cmpgt_epi32(_mm_setzero_si128(), b)) != 0) return false;
    const int64_t* cn = p.cell_next.data();
    const __m256i next = _mm256_setr_epi64x(cn[cs[0]], cn[cs[1]], cn[cs[2]], cn[cs[3]]);
    // -1 in the low half of each 64-bit lane where x passes the cell's threshold.
    const __m256i up = _mm256_permutevar8x32_epi32(_mm256_cmpgt_epi64(x, next), _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_sub_epi32(b, _mm256_castsi256_si128(up)));
    return true;
  }

  // Head h's pos_bias window, or nullptr without pos_bias. Read in place where a row's whole blocks stay
  // inside pos_bias's row (Lp <= M: the furthest read, row 0's column Lp - 1, is at M - L + (L - 1) +
  // (Lp - 1) <= 2M - 2; the columns past a row's span then read other pairs' biases, never used);
  // else from a copy padded with zeros (its fill and memmove per head: see the header).
  const float* pos_of(const Params& p, int64_t L, int64_t h) {
    if (p.pos_bias == nullptr) return nullptr;
    if (round8(L) <= p.M) return p.pos_bias + (p.pos_heads == 1 ? 0 : h) * (2 * p.M - 1) + (p.M - L);
    // Two windows: the forward's head pairs hold both at once (head h's in window h % 2).
    std::vector<float>& w = pos_window[p.pos_heads == 1 ? 0 : h & 1];
    if (h == 0 || p.pos_heads > 1) {
      w.assign(round8(L) + L, 0.0f);
      const float* src = p.pos_bias + (p.pos_heads == 1 ? 0 : h) * (2 * p.M - 1) + (p.M - L);
      std::copy(src, src + 2 * L - 1, w.begin());
    }
    return w.data();
  }
};
thread_local ShortSeq short_seq;

bool short_path(const Prepared& in, const SeqInfo& seq) {
  const Params& p = in.p;
  const bool banded = p.contextual_len == 0 && seq.targets == 0;  // SeqMask::init's
  const bool prefix = !banded && p.causal && p.max_attn_len == 0;
  return !p.softmax && in.delta == 0 && seq.len <= kShortMaxLen && p.D % 8 == 0 && p.Dv % 8 == 0 && (banded || prefix);
}

// (table[idx[0]], ..., table[idx[7]]) by eight scalar loads. Not vgatherdps: at the head of the
// weights' exp and divide chain it made that loop ~3x slower on the Xeon (Sapphire Rapids class) this
// was tuned on (21 vs 7 ns per 8 columns in a standalone loop), though a loop of gathers alone ran at
// 2.4 ns.
inline __m256 gather8(const float* table, const int32_t* idx) {
  return _mm256_setr_ps(table[idx[0]], table[idx[1]], table[idx[2]], table[idx[3]], table[idx[4]], table[idx[5]],
                        table[idx[6]], table[idx[7]]);
}

// scale * row[c, c + 8) + pos[c, c + 8) + time[bucket[c, c + 8)] (either bias may be absent).
inline __m256 biased8(__m256 scale, const float* pos, const float* time, const int32_t* bucket, const float* row,
                      int64_t c) {
  __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + c), scale);
  if (pos != nullptr) s = _mm256_add_ps(s, _mm256_loadu_ps(pos + c));
  if (time != nullptr) s = _mm256_add_ps(s, gather8(time, bucket + c));
  return s;
}

// row[c] <- silu(scale * row[c] + pos[c] + time[bucket[c]]) * inv_m for c in the 8-column blocks
// [lo, hi) of one row (pos: the head's window at the row's offset; either bias may be absent). One pass
// per block in registers: scores_tile's per-row loops, and its scalar tails, cost more than the
// products at these lengths.
void bias_silu_row(float scale, const float* pos, const float* time, const int32_t* bucket, int64_t lo, int64_t hi,
                   float inv_m, float* row) {
  const __m256 vscale = _mm256_set1_ps(scale), one = _mm256_set1_ps(1.0f), vm = _mm256_set1_ps(inv_m);
  for (int64_t c = lo; c < hi; c += 8) {
    const __m256 s = biased8(vscale, pos, time, bucket, row, c);
    const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_setzero_ps(), s));
    _mm256_storeu_ps(row + c, _mm256_mul_ps(_mm256_div_ps(s, _mm256_add_ps(one, e)), vm));
  }
}

// The backward's P and dS of one row from its raw scores s (biased8, then attention.cpp's silu_grad_row,
// ds holding dP on entry), for c in the 8-column blocks [lo, hi): one pass, the biased scores never stored.
void bias_silu_grad_row(float scale, const float* pos, const float* time, const int32_t* bucket, int64_t lo,
                        int64_t hi, float inv_m, const float* s, float* p, float* ds) {
  const __m256 vscale = _mm256_set1_ps(scale), one = _mm256_set1_ps(1.0f), vm = _mm256_set1_ps(inv_m);
  for (int64_t c = lo; c < hi; c += 8) {
    const __m256 x = biased8(vscale, pos, time, bucket, s, c);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, fast_exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    _mm256_storeu_ps(p + c, _mm256_mul_ps(_mm256_mul_ps(x, sig), vm));
    const __m256 g = _mm256_mul_ps(sig, _mm256_add_ps(one, _mm256_mul_ps(x, _mm256_sub_ps(one, sig))));
    _mm256_storeu_ps(ds + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(ds + c), g), vm));
  }
}

// The forward's rows on 16 AVX-512F lanes, taken where the CPU has it (cpu_has_avx512f: a run-time check,
// as the build targets x86-64-v3; GEM_KERNELS_NO_AVX512=1 keeps the 8-lane rows above). A row's blocks
// [lo, hi) stay the 8-column ones of the layouts above and run 16 columns at a time, the last 8 or 16
// wide. What it changes, measured at the model's shape (1 thread, scripts/attention_model_call.py
// --native): the forward ~2.3 -> ~2.05 ms (then bucket_row8: ~1.7). Tried and not kept, as no faster
// there: the scores on 16 lanes (dot_blocks stays), also four rows at a time sharing each key block's
// load (forward 1.7 -> 1.8 ms, backward +4 %); the backward's SiLU rows, dq and dk/dv products on 16
// lanes one row at a time (a 16-lane divide is deeper than an 8-lane one, and these rows are short: ~2
// blocks of 16). Four rows a group, phase by phase, they pay: backward_rows16 (see the header).
inline __mmask16 block_mask(int64_t c, int64_t hi) {
  return hi - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(0x00FF);
}

// A block of 16 columns, or of 8 under m = 0x00FF, by a plain zmm or ymm load or store, not a masked
// one: a masked store does not forward to a later load of the same row.
GK_AVX512 inline __m512 load_block(const float* x, __mmask16 m) {
  return m == 0xFFFF ? _mm512_loadu_ps(x) : _mm512_zextps256_ps512(_mm256_loadu_ps(x));
}
GK_AVX512 inline void store_block(float* x, __mmask16 m, __m512 v) {
  if (m == 0xFFFF)
    _mm512_storeu_ps(x, v);
  else
    _mm256_storeu_ps(x, _mm512_castps512_ps256(v));
}

// exp(-x) where only 1 + exp(-x) is used (the 16-lane SiLU rows: x / (1 + exp(-x)), and the sigmoid
// 1 / (1 + exp(-x)) of its gradient): fast_exp16(-x)'s steps less what cannot change 1 + exp(-x), 15
// vector ops against 21 (one clamp, two compares and two blends fewer, the negation folded into the
// constants: n = round(-x * log2e), r = -(n * ln2_hi) - x, the same values as fast_exp16's from -x). For
// x in [-88, 87] it is fast_exp16(-x) exactly; above 87 it gives exp(-87) where fast_exp16 gives 0 (1 +
// either is 1 in fp32); below -88, Inf (fast_exp16's value, kept by the one blend, so a sigmoid there is
// 0 exactly as before); a NaN x gives exp(-87), not NaN, and the row's NaN comes from x itself (x / 1,
// x * 1 and x * (1 - 1) are NaN). So the rows' outputs are unchanged, bit for bit.
GK_AVX512 inline __m512 exp16_neg(__m512 x) {
  const __m512 xc = _mm512_min_ps(x, _mm512_set1_ps(87.0f));  // a NaN x gives 87
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(-1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmsub_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int k = 1; k < kExpPolyTerms; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[k]));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.0f), _CMP_LT_OQ), _mm512_scalef_ps(p, n),
                              _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// A head's time_bias row in registers, for a table of at most 64 entries (num_buckets + 1; the model's
// 33): a pair's bias by vpermt2ps from two (entries 0..31) or four registers, not by 16 scalar loads
// and inserts (gather8) per 16 pairs; exactly 33 entries (regs = 3): entries 0..31 by one vpermt2ps and
// entry 32 from a broadcast under a compare's mask (3 vector ops a block, not 4). regs = 0: a larger
// table, by gather8.
struct TimeRegs {
  __m512 t[4];
  int regs = 0;
};

GK_AVX512 inline TimeRegs time_regs(const float* time, int64_t entries) {
  TimeRegs r;
  if (time == nullptr || entries > 64) return r;
  r.regs = entries <= 32 ? 2 : (entries == 33 ? 3 : 4);
  for (int k = 0; k < (r.regs == 3 ? 2 : r.regs); ++k) {
    const int64_t n = std::clamp<int64_t>(entries - 16 * k, 0, 16);
    r.t[k] = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), time + 16 * k);
  }
  if (r.regs == 3) r.t[2] = _mm512_set1_ps(time[32]);
  return r;
}

// The time bias of 16 pairs from their buckets idx (tr.regs > 0). at32: the lanes of bucket 32, read only
// where regs = 3 (buckets_at32: one compare, which forward_rows16's head pairs share).
GK_AVX512 inline __m512 time_of_buckets(const TimeRegs& tr, __m512i idx, __mmask16 at32) {
  __m512 t = _mm512_permutex2var_ps(tr.t[0], idx, tr.t[1]);
  if (tr.regs == 3) return _mm512_mask_mov_ps(t, at32, tr.t[2]);
  if (tr.regs == 4)
    t = _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), t,
                             _mm512_permutex2var_ps(tr.t[2], idx, tr.t[3]));
  return t;
}
GK_AVX512 inline __mmask16 buckets_at32(const TimeRegs& tr, __m512i idx) {
  return tr.regs == 3 ? _mm512_cmpeq_epi32_mask(idx, _mm512_set1_epi32(32)) : static_cast<__mmask16>(0);
}

// biased8 on the 16 (or, under m = 0x00FF, 8) columns at c.
GK_AVX512 inline __m512 biased16(__m512 scale, const float* pos, const float* time, const TimeRegs& tr,
                                 const int32_t* bucket, const float* row, int64_t c, __mmask16 m) {
  __m512 s = _mm512_mul_ps(load_block(row + c, m), scale);
  if (pos != nullptr) s = _mm512_add_ps(s, load_block(pos + c, m));
  if (time == nullptr) return s;
  if (tr.regs > 0) {
    const __m512i idx = _mm512_castps_si512(load_block(reinterpret_cast<const float*>(bucket + c), m));
    return _mm512_add_ps(s, time_of_buckets(tr, idx, buckets_at32(tr, idx)));
  }
  // The upper 8 buckets only where they are the row's (past hi they are not written).
  const __m256 lo = gather8(time, bucket + c), hi = m == 0xFFFF ? gather8(time, bucket + c + 8) : _mm256_setzero_ps();
  return _mm512_add_ps(s, _mm512_castpd_ps(_mm512_insertf64x4(_mm512_zextpd256_pd512(_mm256_castps_pd(lo)),
                                                              _mm256_castps_pd(hi), 1)));
}

// gather_rows on 16 lanes, width a multiple of 16: four keys per step into separate accumulators.
GK_AVX512 __attribute__((always_inline)) inline void gather_rows16(const float* w, const float* x, int64_t ldx,
                                                                   int64_t c0, int64_t c1, int64_t width, float* acc) {
  for (int64_t d = 0; d < width; d += 16) {
    __m512 a[4] = {_mm512_loadu_ps(acc + d), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t c = c0;
    for (; c + 4 <= c1; c += 4)
      for (int k = 0; k < 4; ++k)
        a[k] = _mm512_fmadd_ps(_mm512_set1_ps(w[c + k]), _mm512_loadu_ps(x + (c + k) * ldx + d), a[k]);
    for (; c < c1; ++c) a[0] = _mm512_fmadd_ps(_mm512_set1_ps(w[c]), _mm512_loadu_ps(x + c * ldx + d), a[0]);
    _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
  }
}

// a[j] += w[c'] * x[c' * ldx + (0, 16)] for the keys c' = c + 4m + j of [c, c1) (a last partial step's
// keys into a[0], a[1], a[2]): gather_rows16's steps, for a caller that keeps the four accumulators in
// registers over more than one run.
GK_AVX512 __attribute__((always_inline)) inline void gather_run16(const float* w, const float* x, int64_t ldx,
                                                                  int64_t c, int64_t c1, __m512 a[4]) {
  for (; c + 4 <= c1; c += 4)
    for (int j = 0; j < 4; ++j)
      a[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[c + j]), _mm512_loadu_ps(x + (c + j) * ldx), a[j]);
  for (int j = 0; c < c1; ++c, ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[c]), _mm512_loadu_ps(x + c * ldx), a[j]);
}

// What one head's rows read in forward_rows16: q and v rows at their [N, H, *] strides, the
// transposed keys, the head's pos_bias window and time_bias row (nullptr when absent), the sequence's
// bucket tile (row i at i * Lp).
struct HeadRows {
  const float *q0, *v0, *kt, *pos, *time;
  const int32_t* bucket;
  int64_t qs, vs, D, Dv, L, Lp, time_entries;
  float scale, inv_m;
};

// The forward of rows [i0, i0 + n) (n <= 4) of NH heads (1, or 2: a pair of heads): each phase (scores,
// weights, P V) over the group's rows before the next, so that the rows' exp and divide chains overlap
// (a model row is ~2 blocks of 16: one row's chain alone is latency-bound). Head hh's row k: scores and
// weights in s + (hh * 4 + k) * Lp, out row dst[hh * 4 + k], zeroed by the caller. The heads share
// their rows' spans, block loops and bucket loads (NH = 2: see the header).
template <int NH>
GK_AVX512 void forward_rows16(const HeadRows* hr, const RowSpan* spans, int64_t i0, int64_t n, float* s,
                              float* const* dst) {
  const HeadRows& h = hr[0];  // L, Lp, D, Dv, bucket, scale, inv_m and time_entries: every head's
  int64_t lo[4], hi[4];
  for (int64_t k = 0; k < n; ++k) {
    const RowSpan& span = spans[i0 + k];
    const bool any = span.end > span.begin;
    lo[k] = any ? span.begin & ~int64_t{7} : 0;
    hi[k] = any ? round8(span.end) : 0;
    for (int hh = 0; hh < NH; ++hh)
      dot_blocks(hr[hh].q0 + (i0 + k) * h.qs, h.D, hr[hh].kt, h.Lp, lo[k] / 8, hi[k] / 8, s + (hh * 4 + k) * h.Lp);
  }
  const __m512 vscale = _mm512_set1_ps(h.scale), one = _mm512_set1_ps(1.0f), vm = _mm512_set1_ps(h.inv_m);
  TimeRegs tr[NH];
  for (int hh = 0; hh < NH; ++hh) tr[hh] = time_regs(hr[hh].time, h.time_entries);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = i0 + k;
    const int32_t* bucket = h.bucket + i * h.Lp;
    for (int64_t c = lo[k]; c < hi[k]; c += 16) {
      const __mmask16 m = block_mask(c, hi[k]);
      if (NH == 1 || tr[0].regs == 0) {
        for (int hh = 0; hh < NH; ++hh) {
          const float* pos = hr[hh].pos != nullptr ? hr[hh].pos + (h.L - 1 - i) : nullptr;
          float* row = s + (hh * 4 + k) * h.Lp;
          const __m512 x = biased16(vscale, pos, hr[hh].time, tr[hh], bucket, row, c, m);
          const __m512 e = exp16_neg(x);
          store_block(row + c, m, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), vm));
        }
        continue;
      }
      // biased16's steps for both heads, one load of the block's buckets (time tables in registers).
      const __m512i idx = _mm512_castps_si512(load_block(reinterpret_cast<const float*>(bucket + c), m));
      const __mmask16 at32 = buckets_at32(tr[0], idx);  // both heads' tables have time_entries entries
      __m512 x[NH];
      for (int hh = 0; hh < NH; ++hh) {
        x[hh] = _mm512_mul_ps(load_block(s + (hh * 4 + k) * h.Lp + c, m), vscale);
        if (hr[hh].pos != nullptr) x[hh] = _mm512_add_ps(x[hh], load_block(hr[hh].pos + (h.L - 1 - i) + c, m));
        x[hh] = _mm512_add_ps(x[hh], time_of_buckets(tr[hh], idx, at32));
      }
      for (int hh = 0; hh < NH; ++hh) {
        const __m512 e = exp16_neg(x[hh]);
        store_block(s + (hh * 4 + k) * h.Lp + c, m, _mm512_mul_ps(_mm512_div_ps(x[hh], _mm512_add_ps(one, e)), vm));
      }
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    if (lo[k] >= hi[k]) continue;
    const Runs r = runs_of(spans[i0 + k]);  // whole blocks: the columns outside the runs are never read
    for (int hh = 0; hh < NH; ++hh) {
      const float* w = s + (hh * 4 + k) * h.Lp;
      float* o = dst[hh * 4 + k];
      if (h.Dv % 16 == 0) {
        gather_rows16(w, hr[hh].v0, h.vs, r.a0, r.a1, h.Dv, o);
        if (r.b0 < r.b1) gather_rows16(w, hr[hh].v0, h.vs, r.b0, r.b1, h.Dv, o);
      } else {
        gather_rows(w, hr[hh].v0, h.vs, r.a0, r.a1, h.Dv, o);
        gather_rows(w, hr[hh].v0, h.vs, r.b0, r.b1, h.Dv, o);
      }
    }
  }
}

// The forward of one sequence, every head: out rows written.
void forward_seq_short(const Prepared& in, const SeqInfo& seq, Workspace& ws, float* op, const CachedBuckets& cached) {
  const Params& p = in.p;
  const int64_t L = seq.len, Lp = round8(L), H = p.H, D = p.D, Dv = p.Dv, qs = H * D, vs = H * Dv;
  if (L == 0) return;
  const float inv_m = p.M > 0 ? 1.0f / static_cast<float>(p.M) : 0.0f;
  const bool wide = cpu_has_avx512f();
  ShortSeq& sq = short_seq;
  sq.init(p, seq, ws, wide, cached);
  float* s = ws.s.data();  // one row's scores and weights (four rows' of one or two heads on 16 lanes)
  const float* time0 = p.time_bias;
  const int64_t nt = p.num_buckets + 1;
  auto time_of = [&](int64_t h) { return time0 != nullptr ? time0 + (p.time_heads == 1 ? 0 : h) * nt : nullptr; };
  if (wide) {
    // Heads in pairs (forward_rows16<2>), a last odd head alone; both heads' keys by one transpose (head
    // h + 1's columns follow head h's in a k row: rows [0, D) of the copy are head h's, [D, 2D) h + 1's).
    ws.k_rows.resize(2 * D * Lp);
    for (int64_t h = 0, nh = 1; h < H; h += nh) {
      nh = h + 1 < H ? 2 : 1;
      transpose_rows(in.k.const_data_ptr<float>() + (seq.start * H + h) * D, qs, L, nh * D, ws.k_rows.data());
      HeadRows rows[2];
      for (int hh = 0; hh < nh; ++hh)
        rows[hh] = HeadRows{in.q.const_data_ptr<float>() + (seq.start * H + h + hh) * D,
                            in.v.const_data_ptr<float>() + (seq.start * H + h + hh) * Dv, ws.k_rows.data() + hh * D * Lp,
                            sq.pos_of(p, L, h + hh), time_of(h + hh), ws.bucket.data(), qs, vs, D, Dv, L, Lp, nt, p.scale,
                            inv_m};
      for (int64_t i0 = 0; i0 < L; i0 += 4) {
        const int64_t n = std::min<int64_t>(4, L - i0);
        float* dst[8];
        for (int hh = 0; hh < nh; ++hh)
          for (int64_t k = 0; k < n; ++k) {
            dst[hh * 4 + k] = op + ((seq.start + i0 + k) * H + h + hh) * Dv;
            zero_row8(dst[hh * 4 + k], Dv);
          }
        if (nh == 2)
          forward_rows16<2>(rows, sq.spans.data(), i0, n, s, dst);
        else
          forward_rows16<1>(rows, sq.spans.data(), i0, n, s, dst);
      }
    }
    return;
  }
  ws.k_rows.resize(D * Lp);
  for (int64_t h = 0; h < H; ++h) {
    const float* q0 = in.q.const_data_ptr<float>() + (seq.start * H + h) * D;
    const float* v0 = in.v.const_data_ptr<float>() + (seq.start * H + h) * Dv;
    transpose_rows(in.k.const_data_ptr<float>() + (seq.start * H + h) * D, qs, L, D, ws.k_rows.data());
    const float* pos = sq.pos_of(p, L, h);
    const float* time = time_of(h);
    for (int64_t i = 0; i < L; ++i) {
      float* dst = op + ((seq.start + i) * H + h) * Dv;
      zero_row8(dst, Dv);
      const RowSpan& span = sq.spans[i];
      if (span.end <= span.begin) continue;
      const int64_t lo = span.begin & ~int64_t{7}, hi = round8(span.end);
      dot_blocks(q0 + i * qs, D, ws.k_rows.data(), Lp, lo / 8, hi / 8, s);
      bias_silu_row(p.scale, pos != nullptr ? pos + (L - 1 - i) : nullptr, time, ws.bucket.data() + i * Lp, lo,
                    hi, inv_m, s);
      const Runs r = runs_of(span);  // whole blocks: the columns outside the runs are never read
      gather_rows(s, v0, vs, r.a0, r.a1, Dv, dst);
      gather_rows(s, v0, vs, r.b0, r.b1, Dv, dst);
    }
  }
}

// dst[c] += x[c] for c in [c0, c1).
inline void add_range(const float* x, int64_t c0, int64_t c1, float* dst) {
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(dst + c, _mm256_add_ps(_mm256_loadu_ps(dst + c), _mm256_loadu_ps(x + c)));
  for (; c < c1; ++c) dst[c] += x[c];
}

// hist[k * n + bucket[c]] += ds[c] for c in [c0, c1), k = c % 4: four copies, so that consecutive
// keys of one bucket (the usual case) do not wait on each other's store; no data-dependent branch
// (add_by_bucket's run detection mispredicted every few keys at the model's bucket runs).
inline void add_by_bucket4(const int32_t* bucket, const float* ds, int64_t c0, int64_t c1, int64_t n, float* hist) {
  for (int64_t c = c0; c < c1; ++c) hist[(c & 3) * n + bucket[c]] += ds[c];
}

// add_by_bucket4 for two heads at once (H = 2), a bucket's two sums side by side: hist[2 * (k * n +
// bucket[c]) + h] += ds_h[c], one 64-bit load, add and store for both; 8 copies, 8 keys a step, key
// c0 + 8j + k into copy k (a run's last c1 - c0 mod 8 keys into copies 0, 1, ...), each copy at a
// fixed pointer: a key costs its bucket's load, the two dS loads (one inserted) and the pair's load,
// add and store (~6 instructions; 4 copies indexed by c % 4 took ~10, and 8 copies of that loop ran no
// faster: it was bound by its instructions, not by a copy's store-to-load chain).
inline void add_by_bucket8_pair(const int32_t* bucket, const float* ds0, const float* ds1, int64_t c0, int64_t c1,
                                int64_t n, float* hist) {
  double* h = reinterpret_cast<double*>(hist);
  auto add = [ds0, ds1](double* x, int64_t c) {
    const __m128 v = _mm_insert_ps(_mm_load_ss(ds0 + c), _mm_load_ss(ds1 + c), 0x10);
    _mm_store_sd(x, _mm_castps_pd(_mm_add_ps(_mm_castpd_ps(_mm_load_sd(x)), v)));
  };
  int64_t c = c0;
  for (; c + 8 <= c1; c += 8)
    for (int64_t k = 0; k < 8; ++k) add(h + k * n + bucket[c + k], c + k);
  for (int64_t k = 0; c < c1; ++c, ++k) add(h + k * n + bucket[c], c);
}

// What one head's rows read and write in backward_rows16: q, k (for dq) and dO rows at their [N, H, *]
// strides, the transposed keys and values, the pos_bias window and time_bias row (nullptr when absent),
// the bucket tile, the s, P and dS tiles (row i at i * Lp), the dq rows, the head's pos-bias partial
// (nullptr when absent) and add_by_bucket4's histogram (nullptr: no time bias, or the pair histogram
// that backward_seq_short fills after both heads).
struct BackRows {
  const float *q0, *k0, *do0, *kt, *vt, *pos, *time;
  const int32_t* bucket;
  float *s, *pr, *ds, *dq0, *pos_part, *hist;  // hist: add_by_bucket4's (nullptr: the pair histogram)
  int64_t qs, vs, D, Dv, L, Lp, time_entries;
  float scale, inv_m;
  bool scores_done;  // the scores and dP tiles filled before the rows (dot_key_block16)
};

// scatter_rows and scatter_rows4 on 16 lanes (width a multiple of 16), the same sums in the same order.
GK_AVX512 void scatter_rows16(const float* w, float alpha, const float* x, int64_t c0, int64_t c1, int64_t width,
                              float* out) {
  for (int64_t d = 0; d < width; d += 16) {
    const __m512 xd = _mm512_mul_ps(_mm512_set1_ps(alpha), _mm512_loadu_ps(x + d));
    for (int64_t c = c0; c < c1; ++c) {
      float* o = out + c * width + d;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(w[c]), xd, _mm512_loadu_ps(o)));
    }
  }
}
GK_AVX512 void scatter_rows4_16(const float* w, int64_t ldw, float alpha, const float* x, int64_t ldx, int64_t c0,
                                int64_t c1, int64_t width, float* out) {
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t d = 0; d < width; d += 16) {
    const __m512 x0 = _mm512_mul_ps(va, _mm512_loadu_ps(x + d)), x1 = _mm512_mul_ps(va, _mm512_loadu_ps(x + ldx + d));
    const __m512 x2 = _mm512_mul_ps(va, _mm512_loadu_ps(x + 2 * ldx + d));
    const __m512 x3 = _mm512_mul_ps(va, _mm512_loadu_ps(x + 3 * ldx + d));
    for (int64_t c = c0; c < c1; ++c) {
      float* o = out + c * width + d;
      const __m512 a = _mm512_fmadd_ps(_mm512_set1_ps(w[ldw + c]), x1,
                                       _mm512_fmadd_ps(_mm512_set1_ps(w[c]), x0, _mm512_loadu_ps(o)));
      const __m512 b = _mm512_fmadd_ps(_mm512_set1_ps(w[3 * ldw + c]), x3, _mm512_mul_ps(_mm512_set1_ps(w[2 * ldw + c]), x2));
      _mm512_storeu_ps(o, _mm512_add_ps(a, b));
    }
  }
}

// r[j][k] <- r[k][j] for a 16 x 16 block in registers (64 shuffles: unpack, 128-bit-lane shuffles, two
// rounds of 128-bit-block shuffles).
GK_AVX512 inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    u[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
    u[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
    u[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
    u[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
  }
  // u[4k + j], 128-bit block l: r[4k .. 4k + 3][4l + j].
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
  }
}

// For 16 rows, the lanes [0, x[r] - c0) of the 16-key block at c0 (x[r] - c0 clamped to [0, 16]; a shift
// by 16 gives 0xFFFF).
GK_AVX512 inline __m512i lanes_below(const int32_t* x, __m512i c0) {
  const __m512i n = _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(_mm512_loadu_si512(x), c0), _mm512_setzero_si512()),
                                     _mm512_set1_epi32(16));
  return _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(1), n), _mm512_set1_epi32(1));
}

// Which rows see which keys of each 16-key block (the rows of dot_key_block16 and key_block16): block
// b's rows are entries [start[b], start[b + 1]) of row (ascending) and mask (the lanes the row sees,
// never 0). Once per sequence, for every head; a row that sees none of a block's keys is not listed,
// so the blocks' row loops have no branch on it. Built 16 rows at a time: each row's two runs once, as
// 32-bit columns (rows past L: empty runs), then per block the lanes by clamps and variable shifts, and
// the listed rows and masks by compress (a row and block at a time, its clamps and shifts were ~1/3 of
// backward_seq_short's samples).
struct KeyBlockRows {
  std::vector<int32_t> row, start;
  std::vector<uint16_t> mask;
  std::vector<int32_t> runs;  // 4 columns of L rounded up to 16: a0, a1, b0, b1

  GK_AVX512 void init(const RowSpan* spans, int64_t L) {
    const int64_t nb = (L + 15) / 16, L16 = 16 * nb;
    row.resize(nb * L + 16);  // + 16: each step stores 16 entries, keeping the listed ones
    mask.resize(nb * L + 16);
    start.resize(nb + 1);
    runs.assign(4 * L16, 0);
    int32_t* ra = runs.data();
    for (int64_t i = 0; i < L; ++i) {
      const Runs r = runs_of(spans[i]);
      ra[i] = static_cast<int32_t>(r.a0);
      ra[L16 + i] = static_cast<int32_t>(r.a1);
      ra[2 * L16 + i] = static_cast<int32_t>(r.b0);
      ra[3 * L16 + i] = static_cast<int32_t>(r.b1);
    }
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t n = 0;
    for (int64_t b = 0; b < nb; ++b) {
      start[b] = static_cast<int32_t>(n);
      const __m512i c0 = _mm512_set1_epi32(static_cast<int32_t>(16 * b));
      for (int64_t i0 = 0; i0 < L16; i0 += 16) {
        const __m512i m = _mm512_or_si512(_mm512_andnot_si512(lanes_below(ra + i0, c0), lanes_below(ra + L16 + i0, c0)),
                                          _mm512_andnot_si512(lanes_below(ra + 2 * L16 + i0, c0),
                                                              lanes_below(ra + 3 * L16 + i0, c0)));
        const __mmask16 k = _mm512_test_epi32_mask(m, m);
        _mm512_storeu_si512(row.data() + n,
                            _mm512_maskz_compress_epi32(k, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i0)))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(mask.data() + n),
                            _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(k, m)));
        n += __builtin_popcount(k);
      }
    }
    start[nb] = static_cast<int32_t>(n);
  }
};
thread_local KeyBlockRows key_block_rows;

// out[i * Lp + c] = sum_d x[i * ldx + d] * y[c * ldy + d] for the keys c of the 16-key block b (8
// where the block is the tile's last 8 columns) and the rows i that see any of them (kb): the
// backward's scores (x = q, y = k) or dP (x = dO, y = v) of one head at D = 16, the block's 16 key
// rows transposed in registers (transpose16; zeros past L) and held there over its rows (a row: 16
// FMAs, x[i, d] broadcast from memory, in 4 chains, one store). dot_blocks, per row, loads a
// transposed copy of the keys (transpose_rows) for every row and 8-column block, and does twice the
// FMAs on 8 lanes. The row pass then reads a row's 8-column blocks [lo, hi) as before: where a hole
// leaves a whole 16-key block of them unlisted, those columns keep what the tile held, and like the
// columns outside the runs they are never read past the P / dS pass.
GK_AVX512 void dot_key_block16(const float* y, int64_t ldy, int64_t L, int64_t Lp, const float* x, int64_t ldx,
                               const KeyBlockRows& kb, int64_t b, float* out) {
  const int64_t c0 = 16 * b, e0 = kb.start[b], e1 = kb.start[b + 1];
  const bool half = c0 + 16 > Lp;
  __m512 t[16];  // the block's key rows (zeros past L), transposed: t[d] = y[c0 .. c0 + 15, d]
  if (c0 + 16 <= L)
    for (int j = 0; j < 16; ++j) t[j] = _mm512_loadu_ps(y + (c0 + j) * ldy);
  else
    for (int j = 0; j < 16; ++j) t[j] = c0 + j < L ? _mm512_loadu_ps(y + (c0 + j) * ldy) : _mm512_setzero_ps();
  transpose16(t);
  const int32_t* rows = kb.row.data();
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t i = rows[e];
    const float* xi = x + i * ldx;
    __m512 a[4];
    for (int k = 0; k < 4; ++k) a[k] = _mm512_mul_ps(t[k], _mm512_set1_ps(xi[k]));
    for (int d = 4; d < 16; d += 4)
      for (int k = 0; k < 4; ++k) a[k] = _mm512_fmadd_ps(t[d + k], _mm512_set1_ps(xi[d + k]), a[k]);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
    store_block(out + i * Lp + c0, half ? 0x00FF : 0xFFFF, sum);
  }
}

// out[c * ldo + d] = alpha * sum_i w[i * Lp + c] * x[i * ldx + d] over the rows i that see key c
// (kb: the rows of block b and the lanes each sees), for the keys c of the 16-key block b below L and d <
// width (a multiple of 16): the backward's dk (w = dS, x = q) or dv (w = P, x = dO) rows of one key
// block with the keys in lanes. A block's 16 x 16 sums stay in 16 registers over all its rows (one
// FMA a row and d, each with its x[i, d] broadcast from memory, under the row's mask: an invisible
// pair is never multiplied, so an Inf or NaN row adds nothing to the keys it does not see), are
// transposed once and written over their output rows: no accumulator rows, no fill, no copy-out,
// and no per-row loop over a run of keys (scatter_rows4_16 / scatter_rows16 load and store a dk row
// per key and four rows, and their runs' lengths change from row to row).
GK_AVX512 void key_block16(const float* w, int64_t Lp, const float* x, int64_t ldx, int64_t width, float alpha,
                           const KeyBlockRows& kb, int64_t b, int64_t L, float* out, int64_t ldo) {
  const int64_t c0 = 16 * b, e0 = kb.start[b], e1 = kb.start[b + 1];
  const int32_t* rows = kb.row.data();
  const uint16_t* masks = kb.mask.data();
  for (int64_t d0 = 0; d0 < width; d0 += 16) {
    __m512 a[16];
    for (int k = 0; k < 16; ++k) a[k] = _mm512_setzero_ps();
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t i = rows[e];
      const __mmask16 m = masks[e];
      const __m512 wi = _mm512_maskz_loadu_ps(m, w + i * Lp + c0);
      const float* xi = x + i * ldx + d0;
      for (int k = 0; k < 16; ++k) a[k] = _mm512_mask3_fmadd_ps(wi, _mm512_set1_ps(xi[k]), a[k], m);
    }
    // a[d] holds the block's keys in lanes: transposed to key rows.
    transpose16(a);
    const __m512 va = _mm512_set1_ps(alpha);
    const int64_t n = std::min<int64_t>(16, L - c0);
    for (int64_t j = 0; j < n; ++j) _mm512_storeu_ps(out + (c0 + j) * ldo + d0, _mm512_mul_ps(a[j], va));
  }
}

// dk and dv of one head (D and Dv multiples of 16) by key_block16, from the head's dS and P tiles.
GK_AVX512 void key_blocks16(const KeyBlockRows& kb, int64_t L, int64_t Lp, const float* ds, const float* pr,
                            const float* q0, int64_t qs, int64_t D, const float* do0, int64_t vs, int64_t Dv,
                            float scale, float* dk0, float* dv0) {
  for (int64_t b = 0; b * 16 < L; ++b) {
    key_block16(ds, Lp, q0, qs, D, scale, kb, b, L, dk0, qs);
    key_block16(pr, Lp, do0, vs, Dv, 1.0f, kb, b, L, dv0, vs);
  }
}

// The backward row pass of rows [i0, i0 + n) (n <= 4) of one head on 16 lanes, each phase over the
// group's rows before the next, as in forward_rows16: scores and dP (dot_blocks, 8 lanes; or, at D =
// Dv = 16, filled before the rows by dot_key_block16: scores_done), then P and
// dS (bias_silu_grad_row's steps, lane for lane, the time bias from registers: TimeRegs), then the
// bias gradients and dq (gather_rows16 where D is a multiple of 16). Row i's tiles at i * Lp, as in
// backward_seq_short's 8-lane loop.
GK_AVX512 void backward_rows16(const BackRows& h, const RowSpan* spans, int64_t i0, int64_t n) {
  int64_t lo[4], hi[4];
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = i0 + k, o = i * h.Lp;
    const RowSpan& span = spans[i];
    const bool any = span.end > span.begin;
    lo[k] = any ? span.begin & ~int64_t{7} : 0;
    hi[k] = any ? round8(span.end) : 0;
    if (h.scores_done) continue;
    dot_blocks(h.q0 + i * h.qs, h.D, h.kt, h.Lp, lo[k] / 8, hi[k] / 8, h.s + o);
    dot_blocks(h.do0 + i * h.vs, h.Dv, h.vt, h.Lp, lo[k] / 8, hi[k] / 8, h.ds + o);
  }
  const __m512 vscale = _mm512_set1_ps(h.scale), one = _mm512_set1_ps(1.0f), vm = _mm512_set1_ps(h.inv_m);
  const TimeRegs tr = time_regs(h.time, h.time_entries);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = i0 + k, o = i * h.Lp;
    const float* pos = h.pos != nullptr ? h.pos + (h.L - 1 - i) : nullptr;
    for (int64_t c = lo[k]; c < hi[k]; c += 16) {
      const __mmask16 m = block_mask(c, hi[k]);
      const __m512 x = biased16(vscale, pos, h.time, tr, h.bucket + o, h.s + o, c, m);
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16_neg(x)));
      store_block(h.pr + o + c, m, _mm512_mul_ps(_mm512_mul_ps(x, sig), vm));
      const __m512 g = _mm512_mul_ps(sig, _mm512_add_ps(one, _mm512_mul_ps(x, _mm512_sub_ps(one, sig))));
      store_block(h.ds + o + c, m, _mm512_mul_ps(_mm512_mul_ps(load_block(h.ds + o + c, m), g), vm));
    }
  }
  const __m512 vscale_dq = _mm512_set1_ps(h.scale);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = i0 + k, o = i * h.Lp;
    float* dq_i = h.dq0 + i * h.qs;
    if (lo[k] >= hi[k]) {
      zero_row8(dq_i, h.D);
      continue;
    }
    const Runs r = runs_of(spans[i]);
    const float* ds_i = h.ds + o;
    if (h.pos_part != nullptr) {
      float* dst = h.pos_part + (h.L - 1 - i);  // slot j - i + L - 1
      add_range(ds_i, r.a0, r.a1, dst);
      add_range(ds_i, r.b0, r.b1, dst);
    }
    if (h.hist != nullptr) {
      add_by_bucket4(h.bucket + o, ds_i, r.a0, r.a1, h.time_entries, h.hist);
      add_by_bucket4(h.bucket + o, ds_i, r.b0, r.b1, h.time_entries, h.hist);
    }
    // dq_i = scale * sum_c ds[c] k_c (k rows at their [N, H, D] stride): both runs into four
    // accumulators held in registers, the row written once (no fill, no reload between the runs).
    if (h.D % 16 == 0) {
      for (int64_t d = 0; d < h.D; d += 16) {
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        gather_run16(ds_i, h.k0 + d, h.qs, r.a0, r.a1, a);
        gather_run16(ds_i, h.k0 + d, h.qs, r.b0, r.b1, a);
        _mm512_storeu_ps(dq_i + d,
                         _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])), vscale_dq));
      }
    } else {
      zero_row8(dq_i, h.D);
      gather_rows(ds_i, h.k0, h.qs, r.a0, r.a1, h.D, dq_i);
      gather_rows(ds_i, h.k0, h.qs, r.b0, r.b1, h.D, dq_i);
      for (int64_t d = 0; d < h.D; ++d) dq_i[d] *= h.scale;
    }
  }
}

// The backward of one sequence, every head: dq rows written, dk and dv rows
// accumulated in the workspace and written, bias gradients added to the partials of its items
// (head h: pos_part + h * (2L - 1), time_part + h * (num_buckets + 1)).
void backward_seq_short(const Prepared& in, const SeqInfo& seq, Workspace& ws, const float* dout, float* dq, float* dk,
                        float* dv, float* pos_part, float* time_part, const CachedBuckets& cached) {
  const Params& p = in.p;
  const int64_t L = seq.len, Lp = round8(L), H = p.H, D = p.D, Dv = p.Dv, qs = H * D, vs = H * Dv;
  if (L == 0) return;
  const float inv_m = p.M > 0 ? 1.0f / static_cast<float>(p.M) : 0.0f;
  const int64_t nt = p.num_buckets + 1;
  const bool wide = cpu_has_avx512f();
  ShortSeq& sq = short_seq;
  sq.init(p, seq, ws, wide, cached);
  ws.k_rows.resize(D * Lp);
  ws.v_rows.resize(Dv * Lp);
  float* s = ws.s.data();
  float* pr = ws.pr.data();
  // Two heads with a time bias take their time-bias gradient in one pass after both heads' rows
  // (add_by_bucket8_pair): head h's dS tile at h * L * Lp, and one histogram of bucket pairs.
  const bool pair_hist = H == 2 && p.time_bias != nullptr;
  if (pair_hist) {
    if (ws.dp.size() < static_cast<size_t>(2 * L * Lp)) ws.dp.resize(2 * L * Lp);
    sq.hist.assign(16 * nt, 0.0f);
  }
  // dk and dv by 16-key blocks (key_blocks16) where D and Dv allow, else by the four-row products
  // (scatter_rows4) into accumulator rows; the scores and dP by key blocks too where D = Dv = 16
  // (dot_key_block16), else per row (dot_blocks, from transposed copies of k and v).
  const bool key_blocks = wide && D % 16 == 0 && Dv % 16 == 0;
  const bool key_scores = key_blocks && D == 16 && Dv == 16;
  if (key_blocks) key_block_rows.init(sq.spans.data(), L);
  // At least L rows of D and of Dv: a workspace kept from a call of smaller head dims is smaller.
  if (ws.acc.size() < static_cast<size_t>(L * D)) ws.acc.resize(L * D);
  if (ws.acc2.size() < static_cast<size_t>(L * Dv)) ws.acc2.resize(L * Dv);
  float* dk_acc = ws.acc.data();
  float* dv_acc = ws.acc2.data();
  for (int64_t h = 0; h < H; ++h) {
    float* ds = ws.dp.data() + (pair_hist ? h * L * Lp : 0);  // dP in, dS out
    const float* q0 = in.q.const_data_ptr<float>() + (seq.start * H + h) * D;
    const float* k0 = in.k.const_data_ptr<float>() + (seq.start * H + h) * D;
    const float* v0 = in.v.const_data_ptr<float>() + (seq.start * H + h) * Dv;
    if (!key_scores) {
      transpose_rows(k0, qs, L, D, ws.k_rows.data());
      transpose_rows(v0, vs, L, Dv, ws.v_rows.data());
    }
    const float* pos = sq.pos_of(p, L, h);
    const float* time = p.time_bias != nullptr ? p.time_bias + (p.time_heads == 1 ? 0 : h) * nt : nullptr;
    float* pos_part_h = pos != nullptr ? pos_part + h * (2 * L - 1) : nullptr;
    if (time != nullptr && !pair_hist) sq.hist.assign(4 * nt, 0.0f);
    const float* do0 = dout + (seq.start * H + h) * Dv;
    float* dq0 = dq + (seq.start * H + h) * D;
    if (!key_blocks) {
      std::fill(dk_acc, dk_acc + L * D, 0.0f);
      std::fill(dv_acc, dv_acc + L * Dv, 0.0f);
    }
    // Row by row: scores, dP, P and dS (kept in row i of the tiles for the dk and dv pass below), the
    // bias gradients and dq. The tiles' rows (and the buckets') at stride Lp, not kBlockN: at 512 bytes
    // the rows of s, P, dS and the buckets 8 apart share their L1 sets, ~20 lines a set for a 36-row
    // sequence against 12 ways.
    if (wide) {
      if (key_scores)
        for (int64_t b = 0; 16 * b < L; ++b) {
          dot_key_block16(k0, qs, L, Lp, q0, qs, key_block_rows, b, s);
          dot_key_block16(v0, vs, L, Lp, do0, vs, key_block_rows, b, ds);
        }
      const BackRows rows{q0, k0, do0, ws.k_rows.data(), ws.v_rows.data(), pos, time, ws.bucket.data(), s, pr, ds,
                          dq0, pos_part_h, time != nullptr && !pair_hist ? sq.hist.data() : nullptr, qs, vs, D, Dv, L,
                          Lp, nt, p.scale, inv_m, key_scores};
      for (int64_t i0 = 0; i0 < L; i0 += 4) backward_rows16(rows, sq.spans.data(), i0, std::min<int64_t>(4, L - i0));
    }
    for (int64_t i = 0; i < (wide ? 0 : L); ++i) {
      float* dq_i = dq0 + i * qs;
      zero_row8(dq_i, D);
      const RowSpan& span = sq.spans[i];
      if (span.end <= span.begin) continue;
      const int64_t lo = span.begin & ~int64_t{7}, hi = round8(span.end), o = i * Lp;
      float* s_i = s + o;
      float* ds_i = ds + o;
      const int32_t* bucket = ws.bucket.data() + o;
      dot_blocks(q0 + i * qs, D, ws.k_rows.data(), Lp, lo / 8, hi / 8, s_i);
      dot_blocks(do0 + i * vs, Dv, ws.v_rows.data(), Lp, lo / 8, hi / 8, ds_i);
      bias_silu_grad_row(p.scale, pos != nullptr ? pos + (L - 1 - i) : nullptr, time, bucket, lo, hi, inv_m, s_i,
                         pr + o, ds_i);  // whole blocks, as in the forward
      const Runs r = runs_of(span);
      if (pos_part_h != nullptr) {
        float* dst = pos_part_h + (L - 1 - i);  // slot j - i + L - 1
        add_range(ds_i, r.a0, r.a1, dst);
        add_range(ds_i, r.b0, r.b1, dst);
      }
      if (time != nullptr && !pair_hist) {
        add_by_bucket4(bucket, ds_i, r.a0, r.a1, nt, sq.hist.data());
        add_by_bucket4(bucket, ds_i, r.b0, r.b1, nt, sq.hist.data());
      }
      // dq_i = scale * sum_c ds[c] k_c (k rows at their [N, H, D] stride).
      gather_rows(ds_i, k0, qs, r.a0, r.a1, D, dq_i);
      gather_rows(ds_i, k0, qs, r.b0, r.b1, D, dq_i);
      for (int64_t d = 0; d < D; ++d) dq_i[d] *= p.scale;
    }
    float* dk0 = dk + (seq.start * H + h) * D;
    float* dv0 = dv + (seq.start * H + h) * Dv;
    if (key_blocks) key_blocks16(key_block_rows, L, Lp, ds, pr, q0, qs, D, do0, vs, Dv, p.scale, dk0, dv0);
    // dk_c += scale * ds[i, c] q_i, dv_c += p[i, c] do_i.
    for (int64_t i0 = 0; i0 < (key_blocks ? 0 : L); i0 += 4) {
      const int64_t n = std::min<int64_t>(4, L - i0);
      Runs r[4];
      for (int64_t k = 0; k < n; ++k) r[k] = runs_of(sq.spans[i0 + k]);
      // The keys every row of the group sees (an intersection of first runs) take one pass of four rows;
      // each row's other keys (a causal group's last 1..3 keys, a target's own) its own pass.
      int64_t c0 = 0, c1 = L;
      for (int64_t k = 0; k < n; ++k) {
        c0 = std::max(c0, r[k].a0);
        c1 = std::min(c1, r[k].a1);
      }
      if (n < 4 || c0 >= c1) c0 = c1 = 0;
      if (c0 < c1) {
        if (wide && D % 16 == 0)
          scatter_rows4_16(ds + i0 * Lp, Lp, p.scale, q0 + i0 * qs, qs, c0, c1, D, dk_acc);
        else
          scatter_rows4(ds + i0 * Lp, Lp, p.scale, q0 + i0 * qs, qs, c0, c1, D, dk_acc);
        if (wide && Dv % 16 == 0)
          scatter_rows4_16(pr + i0 * Lp, Lp, 1.0f, do0 + i0 * vs, vs, c0, c1, Dv, dv_acc);
        else
          scatter_rows4(pr + i0 * Lp, Lp, 1.0f, do0 + i0 * vs, vs, c0, c1, Dv, dv_acc);
      }
      for (int64_t k = 0; k < n; ++k) {
        const int64_t i = i0 + k, o = i * Lp;
        const Runs& rk = r[k];
        // rk's first run less [c0, c1) (which lies within it when not empty), then its second run.
        const int64_t parts[3][2] = {{rk.a0, c0 < c1 ? c0 : rk.a1}, {c0 < c1 ? c1 : rk.a1, rk.a1}, {rk.b0, rk.b1}};
        for (const auto& part : parts) {
          if (part[0] >= part[1]) continue;
          if (wide && D % 16 == 0)
            scatter_rows16(ds + o, p.scale, q0 + i * qs, part[0], part[1], D, dk_acc);
          else
            scatter_rows(ds + o, p.scale, q0 + i * qs, part[0], part[1], D, dk_acc);
          if (wide && Dv % 16 == 0)
            scatter_rows16(pr + o, 1.0f, do0 + i * vs, part[0], part[1], Dv, dv_acc);
          else
            scatter_rows(pr + o, 1.0f, do0 + i * vs, part[0], part[1], Dv, dv_acc);
        }
      }
    }
    for (int64_t c = 0; c < (key_blocks ? 0 : L); ++c) {
      copy_row8(dk_acc + c * D, D, dk0 + c * qs);
      copy_row8(dv_acc + c * Dv, Dv, dv0 + c * vs);
    }
    if (time != nullptr && !pair_hist) {
      float* dst = time_part + h * nt;
      const float* hs = sq.hist.data();
      for (int64_t b = 0; b < nt; ++b) dst[b] += (hs[b] + hs[nt + b]) + (hs[2 * nt + b] + hs[3 * nt + b]);
    }
  }
  if (pair_hist) {
    const float* ds0 = ws.dp.data();
    const float* ds1 = ds0 + L * Lp;
    for (int64_t i = 0; i < L; ++i) {
      const RowSpan& span = sq.spans[i];
      if (span.end <= span.begin) continue;
      const Runs r = runs_of(span);
      const int64_t o = i * Lp;
      add_by_bucket8_pair(ws.bucket.data() + o, ds0 + o, ds1 + o, r.a0, r.a1, nt, sq.hist.data());
      add_by_bucket8_pair(ws.bucket.data() + o, ds0 + o, ds1 + o, r.b0, r.b1, nt, sq.hist.data());
    }
    const float* hs = sq.hist.data();
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t b = 0; b < nt; ++b) {
        const float* x = hs + 2 * b + h;
        time_part[h * nt + b] += ((x[0] + x[2 * nt]) + (x[4 * nt] + x[6 * nt])) +
                                 ((x[8 * nt] + x[10 * nt]) + (x[12 * nt] + x[14 * nt]));
      }
  }
}

#else

bool short_path(const Prepared&, const SeqInfo&) { return false; }
void forward_seq_short(const Prepared&, const SeqInfo&, Workspace&, float*, const CachedBuckets&) {}
void backward_seq_short(const Prepared&, const SeqInfo&, Workspace&, const float*, float*, float*, float*, float*,
                        float*, const CachedBuckets&) {}

#endif
