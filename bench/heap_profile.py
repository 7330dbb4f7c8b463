#!/usr/bin/python3
"""Where the live memory of a training step goes, by the capsnet function that allocated it.

Runs `capsnet bench --worker CONFIG` under jemalloc's own heap profiler (Debian's libjemalloc2 is built with
it: `MALLOC_CONF=prof:true`), which dumps the live allocations with their call stacks every 2^26 bytes
allocated. The dump with the most live bytes before the first inference pass (the first dump holding the
inference weight cache, `WeightCache::get`) is the training step's live peak; `jeprof --collapsed`
symbolises it, and every stack is charged to its innermost `capsnet::` frame (to "LibTorch's registries" when
it runs under the loader's static initialisers).

    python3 bench/heap_profile.py [--config fused-bf16] [--capsnet build/bin/capsnet] [--keep DIR]
    python3 bench/heap_profile.py -- build/bin/capsnet train --steps 30 ...   # any command: its live peak

Live bytes only: the process's resident size is higher by the free pages jemalloc keeps and by code and
library data (docs/kernels.md, Memory). Sampled every 256 KiB on average, so buffers under ~1 MB are
approximate; the step runs much slower under the profiler (its figures for time mean nothing).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile


def raw_live_bytes(path):
    """Sum of the sampled live bytes of a heap_v2 dump (no unsampling: only to rank the dumps)."""
    total = 0
    with open(path) as f:
        lines = iter(f)
        for line in lines:
            if line.startswith('@'):
                counts = next(lines).split(':')  # "  t*: objects: bytes [...]"
                total += int(counts[2].split('[')[0])
    return total


def collapsed(capsnet, dump):
    out = subprocess.run(['jeprof', '--collapsed', capsnet, dump], capture_output=True, text=True, check=True)
    stacks = []
    for line in out.stdout.splitlines():
        stack, n = line.rsplit(' ', 1)
        frames = [re.sub(r'<[0-9a-f]+>$', '', f).replace('(anonymous namespace)::', '') for f in stack.split(';')]
        stacks.append((frames, int(n)))
    return stacks


def owner(frames):
    if any('_dl_init' in f for f in frames):
        return "LibTorch's registries (static initialisers at load)"
    for f in reversed(frames):
        if 'capsnet::' in f:
            return re.sub(r'\(.*', '', f)  # drop the argument list
    return '(outside capsnet) ' + re.sub(r'\(.*', '', frames[-1])[:60]


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--capsnet', default='build/bin/capsnet', help='the CLI whose bench worker runs')
    p.add_argument('--config', default='fused-bf16', help="the worker's configuration (capsnet bench --configs)")
    p.add_argument('--batch-size', type=int, default=100)
    p.add_argument('--steps', type=int, default=3, help='training steps (the peak is there from the second one)')
    p.add_argument('--image-size', type=int, default=28)
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--keep', help='keep the dumps in this folder')
    p.add_argument('--dumps', help="read the dumps a --keep run left in this folder instead of running the worker")
    p.add_argument('command', nargs='*', help='after --: a capsnet command to profile instead of the bench worker '
                   '(its live peak over the whole run)')
    a = p.parse_args()
    if shutil.which('jeprof') is None:
        sys.exit('heap_profile: jeprof not found (Debian package libjemalloc-dev)')
    capsnet = os.path.abspath(a.command[0] if a.command else a.capsnet)
    work = a.dumps or a.keep or tempfile.mkdtemp(prefix='capsnet-heap-')
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ)
    env['MALLOC_CONF'] = ','.join(filter(None, [env.get('MALLOC_CONF', ''), 'prof:true', 'lg_prof_interval:26',
                                                'lg_prof_sample:18', f'prof_prefix:{work}/jeprof']))
    if a.command:
        cmd = [capsnet] + a.command[1:]
    else:
        cmd = [capsnet, 'bench', '--worker', a.config, '--batch-size', str(a.batch_size), '--steps', str(a.steps),
               '--infer-batches', '1', '--latency-runs', '1', '--threads', str(a.threads), '--routing-iters', '3',
               '--image-size', str(a.image_size)]
    worker = subprocess.run(cmd, env=env, capture_output=True, text=True) if not a.dumps else None
    if worker is not None and worker.returncode != 0:
        sys.exit(f'heap_profile: {" ".join(cmd)} failed ({worker.returncode}):\n{worker.stderr[-2000:]}')
    dumps = [os.path.join(work, f) for f in os.listdir(work) if f.endswith('.heap')]
    if not dumps:
        sys.exit('heap_profile: no heap dumps: is this jemalloc built with --enable-prof?')
    # The dumps in the order written; for the bench worker, the first one holding the inference weight cache
    # ends the training part.
    dumps.sort(key=lambda d: int(re.search(r'\.(\d+)\.i\d+\.heap$', d).group(1)))
    cache = {}

    def stacks_of(i):
        if i not in cache:
            cache[i] = collapsed(capsnet, dumps[i])
        return cache[i]

    def holds_cache(i):
        return any('WeightCache::get' in f for frames, _ in stacks_of(i) for f in frames)

    def training_end():  # binary search: holds_cache is false before the boundary, true from it on
        lo, hi = 0, len(dumps)
        while lo < hi:
            mid = (lo + hi) // 2
            if holds_cache(mid):
                hi = mid
            else:
                lo = mid + 1
        if lo == 0:
            sys.exit('heap_profile: the first dump already holds the inference cache')
        return lo

    end = len(dumps) if a.command else training_end()
    best = max(range(end), key=lambda i: raw_live_bytes(dumps[i]))
    by_owner = collections.Counter()
    for frames, n in stacks_of(best):
        by_owner[owner(frames)] += n
    total = sum(by_owner.values())
    what = ('`' + ' '.join(a.command) + '`' if a.command else
            f'the training part of `capsnet bench --worker {a.config}` (batch {a.batch_size}, {a.image_size}x{a.image_size})')
    print(f'# live memory at the peak of {what}; dump {os.path.basename(dumps[best])} of {len(dumps)}')
    print('| allocated under | MB |\n|---|---:|')
    for name, n in by_owner.most_common():
        if n >= 0.5 * 2**20:
            print(f'| `{name}` | {n / 2**20:.1f} |')
    rest = sum(n for n in by_owner.values() if n < 0.5 * 2**20)
    print(f'| everything under 0.5 MB each | {rest / 2**20:.1f} |')
    print(f'| **live in all** | **{total / 2**20:.1f}** |')
    if not (a.keep or a.dumps):
        shutil.rmtree(work)


if __name__ == '__main__':
    main()
