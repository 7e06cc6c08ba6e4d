"""An independent numpy implementation of the Llama architecture (as HF
transformers defines LlamaForCausalLM / Qwen2ForCausalLM), for checking
kvroute's CPU engine: full causal attention over the whole sequence, no
paging, no KV cache, float64. Reads config.json and model.safetensors.

    python t/ref/llama_ref.py MODEL_DIR '[token ids]'  -> last-token logits (JSON)
"""
import json
import math
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[a:b]
        if t["dtype"] == "F32":
            x = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif t["dtype"] == "F16":
            x = np.frombuffer(raw, dtype="<f2").astype(np.float64)
        elif t["dtype"] == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            x = u.view(np.float32).astype(np.float64)
        else:
            raise ValueError(t["dtype"])
        out[name] = x.reshape(t["shape"])
    return out


def inv_freq(cfg, head_dim):
    # newer transformers configs keep theta and the scaling under rope_parameters
    rp = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rp.get("rope_theta", 10000.0))
    f = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rs = cfg.get("rope_scaling") or rp
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        f = f / rs["factor"]
    elif kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wl = 2 * math.pi / f
        scaled = np.where(wl > low_wl, f / factor, f)
        smooth = (old / wl - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl <= low_wl) & (wl >= high_wl)
        f = np.where(is_mid, mid, scaled)
    return f


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def logits(model_dir, ids):
    cfg = json.load(open(model_dir + "/config.json"))
    W = load_safetensors(model_dir + "/model.safetensors")
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", H // nh)
    eps = cfg.get("rms_norm_eps", 1e-6)
    T = len(ids)
    x = W["model.embed_tokens.weight"][ids]
    f = inv_freq(cfg, hd)
    ang = np.outer(np.arange(T), f)
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        h = rms(x, W[p + "input_layernorm.weight"], eps)
        q = h @ W[p + "self_attn.q_proj.weight"].T + W.get(p + "self_attn.q_proj.bias", 0)
        k = h @ W[p + "self_attn.k_proj.weight"].T + W.get(p + "self_attn.k_proj.bias", 0)
        v = h @ W[p + "self_attn.v_proj.weight"].T + W.get(p + "self_attn.v_proj.bias", 0)
        q = q.reshape(T, nh, hd).transpose(1, 0, 2)
        k = k.reshape(T, nkv, hd).transpose(1, 0, 2)
        v = v.reshape(T, nkv, hd).transpose(1, 0, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, nh // nkv, axis=0)
        v = np.repeat(v, nh // nkv, axis=0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd)
        # Llama's attention_bias puts a bias on o_proj too (Qwen2 has none there)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T + W.get(p + "self_attn.o_proj.bias", 0)
        h = rms(x, W[p + "post_attention_layernorm.weight"], eps)
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"], eps)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return x[-1] @ head.T


if __name__ == "__main__":
    print(json.dumps([float(v) for v in logits(sys.argv[1], json.loads(sys.argv[2]))]))
