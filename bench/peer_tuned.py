#!/usr/bin/python3
"""The tuned plain-PyTorch peer: the paper's MNIST CapsNet, same math as bench/peer_capsnet.py,
written as fast as we know how in eager PyTorch 1.13 on CPU (issue 17), to hold capsnet honest.

Same network and loss as peer_capsnet.py (Conv1 256 9x9 ReLU; PrimaryCaps 32x8 9x9 stride 2;
squash with eps inside the sqrt; u_hat = W u, W [1152, 10, 16, 8]; routing with softmax over the
10 parents and gradients through every iteration; margin loss 0.9/0.1/0.5; masked decoder
160-512-1024-784 sigmoid; loss = margin + 0.0005 * SSE; Adam lr 1e-3). What differs is only how it
is computed:
  * u_hat is ONE batched GEMM over the 1152 input capsules ([I, B, 8] x [I, 8, 160]);
  * routing runs on a [B*10, 1152, 16] layout, so both routing reductions (s = sum_i c u_hat and
    the agreement u_hat . v) are batched GEMVs over contiguous rows (no [B, I, J, D] temporaries);
  * routing is one autograd Function with a hand-written backward: 4 passes over u_hat instead of
    autograd's per-op graph, and the gradient of u_hat written once, as one small-K GEMM;
  * capsules are ordered i = position * 32 + capsule type (the NHWC order of the PrimaryCaps output)
    and W is stored as [1152, 8, 160] in that order; convolutions stay NCHW by default (oneDNN fp32
    measured faster than channels_last here; --channels-last to try it);
  * glibc malloc is told not to hand 74 MB blocks back to the kernel after each use (mallopt), so
    large temporaries do not page-fault on every step (--no-malloc-tune turns this off);
  * inference under torch.inference_mode(); zero_grad(set_to_none=True); Adam(foreach=True);
    flush denormals.
--precision bf16: CPU autocast (bfloat16) around forward + loss; the convolutions and the decoder
run in bf16, while u_hat, routing, squash, lengths and the loss reductions run in fp32 (explicit
casts, autocast disabled there); master weights stay fp32.

Prints one JSON line with the same fields as peer_capsnet.py, plus "precision".
Runnable alone:  /usr/bin/python3 bench/peer_tuned.py --steps 5 [--precision bf16]
Correctness:     /usr/bin/python3 bench/peer_tuned.py --check   (PASS/FAIL against peer_capsnet.py)
"""
import argparse
import contextlib
import ctypes
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import add_peer_args, capsnet_steps, measure_peer  # noqa: E402

I_CAPS, J_CAPS, D_OUT, D_IN = 1152, 10, 16, 8


def tune_malloc():
    """Keep freed large blocks in the heap instead of unmapping them: without this every 74 MB
    u_hat-sized tensor is a fresh mmap whose pages fault in on first touch (~5x slower copies)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except OSError:
        return False


def squash(s, dim=-1, eps=1e-8):
    sq = (s * s).sum(dim, keepdim=True)
    return sq / (1 + sq) * s / torch.sqrt(sq + eps)


def squash_backward(s, gv, eps=1e-8):
    # v = s * g(q), q = |s|^2, g = q / ((1 + q) * n), n = sqrt(q + eps)
    # dv/ds^T gv = g * gv + 2 * g'(q) * (s . gv) * s,  g'(q) = (n - q (1 + q) / (2 n)) / ((1 + q) n)^2
    q = (s * s).sum(-1, keepdim=True)
    n = torch.sqrt(q + eps)
    h = (1 + q) * n
    g = q / h
    dg = (n - q * (1 + q) / (2 * n)) / (h * h)
    return g * gv + (2 * dg * (s * gv).sum(-1, keepdim=True)) * s


def route_forward(uh, B, iters, keep):
    """uh: [B*J, I, D] contiguous. Returns v [B, J, D] and (if keep) the per-iteration c, s, v."""
    N, I, D = uh.shape
    J = N // B
    b = torch.zeros(B, J, I, dtype=uh.dtype)
    cs, ss, vs = [], [], []
    for r in range(iters):
        c = torch.softmax(b, dim=1)                                   # over the J parents
        s = torch.bmm(c.view(N, 1, I), uh).view(B, J, D)              # sum_i c_ij u_hat_j|i
        v = squash(s)
        if keep:
            cs.append(c)
            ss.append(s)
            vs.append(v)
        if r < iters - 1:
            b = b + torch.bmm(uh, v.view(N, D, 1)).view(B, J, I)      # agreement u_hat . v
    return v, (cs, ss, vs)


class CapsRouting(torch.autograd.Function):
    """v = routing(u_hat = W u). uT: [I, B, Din]; W: [I, Din, J*D]. Returns v [B, J, D]."""

    @staticmethod
    def forward(ctx, uT, W, iters):
        I, B, _ = uT.shape
        JD = W.shape[2]
        uh = torch.bmm(uT, W)                                          # ONE batched GEMM: [I, B, J*D]
        uh = uh.view(I, B, J_CAPS, JD // J_CAPS).permute(1, 2, 0, 3).contiguous()  # [B, J, I, D]
        uh = uh.view(B * J_CAPS, I, JD // J_CAPS)
        v, (cs, ss, vs) = route_forward(uh, B, iters, keep=True)
        ctx.iters = iters
        ctx.save_for_backward(uT, W, uh)
        ctx.inter = (cs, ss, vs)
        return v

    @staticmethod
    def backward(ctx, gv):
        uT, W, uh = ctx.saved_tensors
        cs, ss, vs = ctx.inter
        ctx.inter = None
        T = ctx.iters
        N, I, D = uh.shape
        B = N // J_CAPS
        P, Q = [], []            # g_u_hat[n, i, :] = sum_k P_k[n, i] * Q_k[n, :]
        gb = None                # gradient w.r.t. the logits b after iteration r
        for r in range(T - 1, -1, -1):
            gvr = gv.contiguous() if r == T - 1 else None
            if gb is not None:   # b_{r+1} = b_r + u_hat . v_r
                t = torch.bmm(gb.view(N, 1, I), uh).view(B, J_CAPS, D)
                gvr = t if gvr is None else gvr + t
                P.append(gb)
                Q.append(vs[r])
            gs = squash_backward(ss[r], gvr)
            P.append(cs[r])
            Q.append(gs)
            if r > 0:            # b_0 = 0 is a constant: no gradient to carry below iteration 0
                gc = torch.bmm(uh, gs.view(N, D, 1)).view(B, J_CAPS, I)
                c = cs[r]
                gsm = c * (gc - (gc * c).sum(1, keepdim=True))          # softmax backward (over J)
                gb = gsm if gb is None else gb + gsm
        Pm = torch.stack([p.view(N, I) for p in P], dim=1)              # [N, K, I] (cheap concat)
        Qm = torch.stack([q.reshape(N, D) for q in Q], dim=1)           # [N, K, D]
        guh = torch.bmm(Pm.transpose(1, 2), Qm)                          # [N, I, D], written once
        del Pm, Qm, P, Q
        guh = guh.view(B, J_CAPS, I, D).permute(2, 0, 1, 3).contiguous().view(I, B, J_CAPS * D)
        gW = torch.bmm(uT.transpose(1, 2), guh) if ctx.needs_input_grad[1] else None
        guT = torch.bmm(guh, W.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        return guT, gW, None


_conv_bwd = torch.ops.aten.convolution_backward


class PrimaryConvBF16(torch.autograd.Function):
    """PrimaryCaps conv for bf16 training: forward and input-gradient in bf16 (oneDNN), but the
    weight gradient from the same bf16 activations computed by the fp32 kernel, which oneDNN runs
    faster on this CPU than its bf16 weight-gradient kernel (and it is no less accurate)."""

    @staticmethod
    def forward(ctx, h, weight, bias, stride):
        hb, wb = h.to(torch.bfloat16), weight.to(torch.bfloat16)
        ctx.save_for_backward(hb, wb, weight)
        ctx.stride = stride
        return F.conv2d(hb, wb, bias.to(torch.bfloat16), stride=stride)

    @staticmethod
    def backward(ctx, go):
        hb, wb, weight = ctx.saved_tensors
        st, nb = [ctx.stride] * 2, [weight.shape[0]]
        gh = gw = gbias = None
        if ctx.needs_input_grad[0]:
            gh = _conv_bwd(go.to(torch.bfloat16), hb, wb, nb, st, [0, 0], [1, 1], False, [0, 0], 1,
                           [True, False, False])[0]
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            _, gw, gbias = _conv_bwd(go.float(), hb.float(), weight, nb, st, [0, 0], [1, 1], False, [0, 0], 1,
                                     [False, True, True])
        return gh, gw, gbias, None


BF16_FP32_WGRAD = True   # PrimaryConvBF16 in bf16 training (A/B switch for measurements)


class TunedCapsNet(nn.Module):
    def __init__(self, routing_iters=3, channels_last=False):
        super().__init__()
        self.iters = routing_iters
        self.channels_last = channels_last
        self.conv1 = nn.Conv2d(1, 256, 9)
        self.primary = nn.Conv2d(256, 32 * 8, 9, stride=2)
        # W[i, k, j*16 + d] == paper's W_ij[d, k]; i = (row*6 + col) * 32 + capsule type
        self.W = nn.Parameter(0.01 * torch.randn(I_CAPS, D_IN, J_CAPS * D_OUT))
        self.decoder = nn.Sequential(nn.Linear(160, 512), nn.ReLU(), nn.Linear(512, 1024), nn.ReLU(),
                                     nn.Linear(1024, 784), nn.Sigmoid())
        if channels_last:
            self.to(memory_format=torch.channels_last)

    def forward(self, x, y=None):
        B = x.shape[0]
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        h = F.relu(self.conv1(x))
        if (torch.is_autocast_cpu_enabled() and torch.get_autocast_cpu_dtype() == torch.bfloat16
                and BF16_FP32_WGRAD and torch.is_grad_enabled() and self.primary.weight.requires_grad):
            with torch.autocast("cpu", enabled=False):
                p = PrimaryConvBF16.apply(h, self.primary.weight, self.primary.bias, 2)
        else:
            p = self.primary(h)                                          # [B, 256, 6, 6]
        return self.capsules(p, y)

    def capsules(self, p, y):
        """PrimaryCaps' output p [B, 256, 6, 6] -> (lengths [B, 10], reconstruction): squash, routing, decoder."""
        B = p.shape[0]
        with torch.autocast("cpu", enabled=False):                       # capsule part in fp32
            p = p.float()
            # [B, 256, 6, 6] -> [B, 6, 6, 32, 8] -> [I, B, 8] (one small copy)
            uT = p.permute(0, 2, 3, 1).reshape(B, 36, 32, D_IN).permute(1, 2, 0, 3).reshape(I_CAPS, B, D_IN)
            uT = squash(uT)
            W = self.W.float()
            if torch.is_grad_enabled() and (uT.requires_grad or W.requires_grad):
                v = CapsRouting.apply(uT, W, self.iters)
            else:
                uh = torch.bmm(uT, W).view(I_CAPS, B, J_CAPS, D_OUT).permute(1, 2, 0, 3).contiguous()
                v, _ = route_forward(uh.view(B * J_CAPS, I_CAPS, D_OUT), B, self.iters, keep=False)
            lengths = torch.sqrt((v * v).sum(-1))                        # [B, 10] == v.norm(dim=-1)
            if y is None:
                y = lengths.argmax(dim=1)
            masked = (v * F.one_hot(y, J_CAPS).to(v.dtype).unsqueeze(-1)).reshape(B, J_CAPS * D_OUT)
        recon = self.decoder(masked)
        return lengths, recon

    @torch.no_grad()
    def load_from_peer(self, peer):
        """Copy weights from peer_capsnet.PeerCapsNet (W [1, I, J, D, Din], i = type*36 + pos)."""
        self.conv1.load_state_dict(peer.conv1.state_dict())
        self.primary.load_state_dict(peer.primary.state_dict())
        self.decoder.load_state_dict(peer.decoder.state_dict())
        Wp = peer.W.detach()[0].view(32, 36, J_CAPS, D_OUT, D_IN)        # [type, pos, J, D, Din]
        Wp = Wp.permute(1, 0, 4, 2, 3).reshape(I_CAPS, D_IN, J_CAPS * D_OUT)  # [pos*32+type, Din, J*D]
        self.W.copy_(Wp)


def loss_fn(lengths, recon, images, labels):
    with torch.autocast("cpu", enabled=False):                           # reductions in fp32
        lengths = lengths.float()
        recon = recon.float()
        t = F.one_hot(labels, 10).to(lengths.dtype)
        margin = (t * F.relu(0.9 - lengths) ** 2 + 0.5 * (1 - t) * F.relu(lengths - 0.1) ** 2).sum(1).mean()
        sse = ((recon - images.reshape(images.shape[0], -1)) ** 2).sum(1).mean()
        return margin + 0.0005 * sse


def autocast_ctx(precision):
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_check(args):
    """Same weights and inputs through peer_capsnet.PeerCapsNet and TunedCapsNet (fp32)."""
    import peer_capsnet
    torch.manual_seed(args.seed)
    B = min(args.batch_size, 16)
    ref = peer_capsnet.PeerCapsNet(args.routing_iters)
    with torch.no_grad():
        ref.W.mul_(10)   # larger W than the init so routing is far from uniform and squash non-linear
    tuned = TunedCapsNet(args.routing_iters)
    tuned.load_from_peer(ref)
    images = torch.rand(B, 1, 28, 28)
    labels = torch.randint(0, 10, (B,))
    diffs = {}

    def md(a, b):
        return (a.detach().float() - b.detach().float()).abs().max().item()

    with torch.no_grad():   # inference path (argmax masking)
        l0, r0 = ref(images)
        l1, r1 = tuned(images)
        diffs["infer_lengths"], diffs["infer_recon"] = md(l0, l1), md(r0, r1)
    opt0 = torch.optim.Adam(ref.parameters(), lr=1e-3)
    opt1 = torch.optim.Adam(tuned.parameters(), lr=1e-3, foreach=True)
    for step in range(2):   # two training steps: the loss of step 2 sees one Adam update from each
        opt0.zero_grad()
        opt1.zero_grad(set_to_none=True)
        l0, r0 = ref(images, labels)
        loss0 = peer_capsnet.loss_fn(l0, r0, images, labels)
        l1, r1 = tuned(images, labels)
        loss1 = loss_fn(l1, r1, images, labels)
        if step == 0:
            diffs["train_lengths"], diffs["train_recon"] = md(l0, l1), md(r0, r1)
        diffs["loss_step%d" % (step + 1)] = md(loss0, loss1)
        loss0.backward()
        loss1.backward()
        if step == 0:
            ref_W = ref.W.grad[0].view(32, 36, J_CAPS, D_OUT, D_IN).permute(1, 0, 4, 2, 3).reshape(I_CAPS, D_IN, -1)
            scale = max(ref_W.abs().max().item(), 1e-12)
            diffs["grad_W_rel"] = md(ref_W, tuned.W.grad) / scale
            g0 = ref.primary.weight.grad
            diffs["grad_primary_rel"] = md(g0, tuned.primary.weight.grad) / max(g0.abs().max().item(), 1e-12)
            g0 = ref.conv1.weight.grad
            diffs["grad_conv1_rel"] = md(g0, tuned.conv1.weight.grad) / max(g0.abs().max().item(), 1e-12)
        opt0.step()
        opt1.step()
    tol = 1e-4
    ok = all(v <= tol for v in diffs.values())
    print(("PASS" if ok else "FAIL") + " (tol %g, batch %d, loss %.6f) max diffs: " % (tol, B, loss0.item())
          + ", ".join("%s=%.3g" % kv for kv in diffs.items()))
    return 0 if ok else 1


def add_args(ap, channels_last_help):
    """The flags of the tuned and the spectral peer: every peer's (timing.add_peer_args) and theirs."""
    add_peer_args(ap)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--channels-last", action="store_true", help=channels_last_help)
    ap.add_argument("--no-malloc-tune", action="store_true", help="leave glibc malloc at its defaults")


def setup(args):
    """Process settings of the tuned and the spectral peer: malloc tuning, threads, denormals."""
    args.malloc_tuned = False if args.no_malloc_tune else tune_malloc()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)


def measure(model, args, config, impl, extra=None):
    """Times `model` as `capsnet bench` expects (timing.measure_peer) and prints its one JSON line.
    Shared by the tuned and the spectral peer, so both are measured alike."""
    B = args.batch_size
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    images = torch.rand(B, 1, 28, 28)
    labels = torch.randint(0, 10, (B,))
    if args.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)

    train_step, predict = capsnet_steps(model, opt, loss_fn, images, labels,
                                        autocast=lambda: autocast_ctx(args.precision), set_to_none=True)
    @contextlib.contextmanager
    def inference():
        with torch.inference_mode(), autocast_ctx(args.precision):
            yield

    result = {"config": config + ("-bf16" if args.precision == "bf16" else ""),
              "impl": impl + " " + torch.__version__, "threads": torch.get_num_threads()}
    result.update(measure_peer(train_step, model, predict, images, args, inference))
    result.update({"precision": args.precision, "channels_last": args.channels_last,
                   "malloc_tuned": args.malloc_tuned})
    result.update(extra or {})
    print(json.dumps(result))
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap, "channels_last convolutions (measured slower here than NCHW in fp32, equal in bf16)")
    ap.add_argument("--check", action="store_true", help="compare with peer_capsnet.py; PASS/FAIL")
    args = ap.parse_args()
    setup(args)
    if args.check:
        sys.exit(run_check(args))

    torch.manual_seed(args.seed)
    measure(TunedCapsNet(args.routing_iters, channels_last=args.channels_last), args, "peer-tuned",
            "tuned plain PyTorch (Python, eager)")


if __name__ == "__main__":
    main()
