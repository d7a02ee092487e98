"""Timers: device time through CUPTI, CUDA events, CUDA graphs, host wall clock, copy bandwidth.

Device time per call (`cuda_device_time`) is the sum of the durations of the GPU activities
(kernels, memsets, memcpys) that one call issues, read through torch.profiler (CUPTI), with the
L2 cache flushed before every call. Unlike a host clock or events around a region it does not
grow when the host path of a call is slower than its kernels, so it is what the call costs inside
a CUDA graph or a busy stream (less the gaps between its own kernels). Host overhead is measured
separately (`host_time`).  A call's activities are told apart in the trace by a separator
kernel issued before each call: the L2 flush, or for warm-cache timings a tiny `CallMarker`.

torch is imported inside the CUDA functions only, so the CPU mode runs without it.
"""
import statistics
import time

FLUSH_BYTES = 256 * 1024**2  # > 4x the H200's 60 MB L2, so every call starts with a cold cache
COPY_BYTES = 2 * 1024**3  # 2 GiB read + 2 GiB written: about 1 ms on an H200, far above launch cost


class L2Flush:
    """Evicts the L2 cache with one kernel over a 256 MB buffer; `kernel_names` tells it apart.

    mode "write" (`buf.add_(1)`) is the flush the peers' published numbers are measured with;
    it leaves the L2 full of dirty lines that the timed kernel must write back (worth up to ~10%
    of copy bandwidth at 4096x4096: docs/performance.md, Method).
    mode "read" (row sums into a 256 KB buffer) leaves clean lines and measures the kernel alone.
    """

    def __init__(self, mode="write"):
        import torch

        if mode not in ("write", "read"):
            raise ValueError(f"L2Flush: mode must be 'write' or 'read', got {mode!r}")
        self.mode = mode
        self._torch = torch
        self._buf = torch.randint(0, 255, (FLUSH_BYTES,), dtype=torch.uint8, device="cuda")
        # Many short rows, so that torch needs no cross-block reduction (and no memset) for them.
        self._rows = self._buf.view(-1, 8192)
        self._row_sums = torch.empty(self._rows.shape[0], dtype=torch.int64, device="cuda")
        self.kernel_names = _separator_names(self, f"L2Flush ({mode})")

    def __call__(self):
        if self.mode == "write":
            self._buf.add_(1)
        else:
            self._torch.sum(self._rows, dim=1, out=self._row_sums)  # uint8 sums to int64


class CallMarker:
    """A one-element kernel issued before each call where no flush is wanted: it only marks in the
    trace where a call begins, so the device time is measured with the L2 as the previous call
    left it (`kernel_names` tells the marker apart).  bitwise_not on int16 is an op no
    implementation of an RMSNorm issues, so its kernel name cannot be taken for a call's own.
    """

    def __init__(self):
        import torch

        self._word = torch.zeros(1, dtype=torch.int16, device="cuda")
        self.kernel_names = _separator_names(self, "CallMarker")

    def __call__(self):
        self._word.bitwise_not_()


def _separator_names(separator, what):
    """The names of the GPU activities `separator()` issues, found by profiling it alone."""
    import torch

    separator()
    torch.cuda.synchronize()
    names = {name for name, _, _ in _profile_activities(None, separator, 3)}
    if not names:
        raise RuntimeError(f"{what}: the profiler saw no GPU activity (is CUPTI working?)")
    if any(name.startswith(("Memset", "Memcpy")) for name in names):
        # A call's own memsets and copies would then be taken for separators.
        raise RuntimeError(f"{what} issues {sorted(names)}")
    return names


def _profile_activities(fn, flush, iters):
    """[(name, start_us, duration_us)] of the GPU activities of `iters` x (flush; fn), by start."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush()
            if fn is not None:
                fn()
        torch.cuda.synchronize()
    activities = []
    for event in prof.events():
        if "CUDA" not in str(getattr(event, "device_type", "")):
            continue  # host-side record (an op, a cudaLaunchKernel call)
        activities.append((event.name, event.time_range.start, event.time_range.elapsed_us()))
    activities.sort(key=lambda a: a[1])
    return activities


def _split_calls(activities, flush_names):
    """Groups activities into calls: everything between two separators (flushes or markers)
    belongs to one call."""
    calls = []
    after_flush = False
    for name, _, us in activities:
        if name in flush_names:
            if not after_flush:
                calls.append([])
            after_flush = True
        else:
            after_flush = False
            if calls:
                calls[-1].append((name, us))
    return calls


def cuda_device_time(fn, flush, iters=20):
    """Device time of one call of fn, L2 flushed before each: a dict.  With a `CallMarker` as
    `flush`, the same without the flush (warm cache).

    us: median over calls of the summed durations of the call's GPU activities;
    us_min, us_max: their spread; kernels_per_call; kernels: {name: us per call};
    calls_seen: the number of separators found in the trace (iters unless CUPTI lost some).
    """
    calls = _split_calls(_profile_activities(fn, flush, iters), flush.kernel_names)
    per_call = [sum(us for _, us in call) for call in calls]
    if not per_call:
        raise RuntimeError("cuda_device_time: no flush or marker found in the trace")
    kernels = {}
    for call in calls:
        for name, us in call:
            short = name if len(name) <= 120 else name[:117] + "..."
            kernels[short] = kernels.get(short, 0.0) + us / iters
    return {
        # With calls lost or merged, the median is not per call; the mean over iters still is.
        "us": statistics.median(per_call) if len(calls) == iters else sum(per_call) / iters,
        "us_min": min(per_call),
        "us_max": max(per_call),
        "kernels_per_call": sum(len(call) for call in calls) / iters,
        "kernels": kernels,
        "calls_seen": len(calls),
    }


def cuda_event_time(fn, flush, iters=20):
    """Cross-check: median of CUDA events recorded around each call, L2 flushed before each.

    Equals the device time when the flush (~120 us) gives the host enough head start; larger when
    the call's host path is slower than that, or when its kernels leave gaps between them.
    """
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return {"event_us": statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))}


def cuda_graph_time(fn, calls=50, replays=10, warm_calls=3, warm_replays=3):
    """Wall time per call of `calls` calls of fn captured in one CUDA graph, as a serving engine
    replays a decode step: {"graph_us": median over `replays` replays of its CUDA-event time /
    calls, "graph_us_min": the fastest replay's}.

    fn is warmed up on the capture stream first (kernel loads, compilation, allocator pools must
    not happen during capture), and must keep its inputs alive; what it allocates during capture
    comes from the graph's private pool, freed with the graph.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warm_calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    _capture(graph, stream, fn, calls)
    try:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
        # No sync between the warm and the timed replays: the GPU always has replays queued, so a
        # start event never waits idle for the host to submit the replay it times.
        for _ in range(warm_replays):
            graph.replay()
        for start, end in zip(starts, ends):
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        per_call = [s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends)]
    finally:
        torch.cuda.synchronize()
        graph.reset()
    return {"graph_us": statistics.median(per_call), "graph_us_min": min(per_call)}


def _capture(graph, stream, fn, calls):
    """Captures `calls` calls of fn; a failed capture names the error that broke it first (the
    capture's end then fails too and would hide it)."""
    import torch

    try:
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    except Exception as error:
        first = error.__context__
        detail = f"; first: {type(first).__name__}: {first}" if first is not None else ""
        raise RuntimeError(f"CUDA graph capture failed: {error}{detail}") from error


def host_time(fn, sync, calls=1000, repeats=3):
    """Wall-clock microseconds per call for `calls` back-to-back calls and one sync at the end.

    The median of `repeats` runs; host timings on virtual machines move 20-50% between runs,
    so compare implementations measured in the same process.
    """
    fn()
    sync()
    runs = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return {"host_us": statistics.median(runs), "host_us_runs": runs}


def wall_time(fn, min_calls=5, max_calls=200, budget_s=1.0):
    """CPU mode: median wall-clock microseconds of single calls, within a time budget."""
    fn()
    samples = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < max_calls and (len(samples) < min_calls or time.perf_counter() < deadline):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return {"us": statistics.median(samples), "us_min": min(samples), "us_max": max(samples)}


def same_bytes_copy(nbytes):
    """A torch device-to-device copy moving ``nbytes`` (half read, half written), as a callable:
    what the copy engine reaches for an op's own bytes under the same method."""
    import torch
    src = torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda *_: dst.copy_(src)


def _copy_result(seconds_per_copy, nbytes):
    gbps = [2 * nbytes / s / 1e9 for s in seconds_per_copy]  # bytes read + bytes written
    return {"gbps": statistics.median(gbps), "gbps_max": max(gbps), "bytes_moved": 2 * nbytes}


def cuda_copy_bandwidth(nbytes=COPY_BYTES, repeats=10):
    """Device-to-device copy bandwidth in GB/s (read + written), median of `repeats` copies."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return _copy_result(times, nbytes)


def cpu_copy_bandwidth(nbytes=256 * 1024**2, repeats=5):
    """Host memory copy bandwidth in GB/s (read + written), median of `repeats` copies."""
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return _copy_result(times, nbytes)
