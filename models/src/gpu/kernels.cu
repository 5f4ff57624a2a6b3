// The GPU twins of the fused CPU kernels in models/src/cpu/fused and of the in-place optimizer
// passes in models/src/optim.rs: the same formulas, f32, contiguous rows. Compiled at run time
// by NVRTC (models/src/gpu/mod.rs), so neither CI nor a CPU build ever needs nvcc. Plain C:
// NVRTC has no standard headers, so no <math.h> or <cstddef> here.
//
// Row kernels take one warp per row where rows are short (softmax over at most a few hundred
// keys, 256 classes) and one block per row for layer norm and RMS norm. Column sums (a bias's gradient,
// layer norm's weight and bias gradients) go in two passes: partial sums per chunk of rows,
// then the chunks' sums in a fixed order, so a step's gradients are the same on every run.

typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)
#define NAN_F32 __int_as_float(0x7fc00000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum of `v` over the block (blockDim.x a multiple of 32, at most 1024), returned to every
// thread. `shared` holds 32 floats; the leading barrier lets a caller reuse it at once.
__device__ float block_sum(float v, float* shared) {
    v = warp_sum(v);
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float total = 0.0f;
    u32 warps = (blockDim.x + 31u) >> 5;
    for (u32 i = 0; i < warps; ++i) total += shared[i];
    return total;
}

// A row's mean and reciprocal standard deviation (the biased variance, in two passes as the
// CPU's `moments`), computed by the whole block and returned to every thread.
__device__ void row_moments(const float* row, u32 width, float eps, float* shared, float* mean,
                            float* rstd) {
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) s += row[i];
    float m = block_sum(s, shared) / (float)width;
    float q = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        float d = row[i] - m;
        q += d * d;
    }
    *mean = m;
    *rstd = 1.0f / sqrtf(block_sum(q, shared) / (float)width + eps);
}

// out = x + bias, bias as wide as a row.
extern "C" __global__ void p2p_add_bias(const float* x, const float* bias, float* out, u64 n,
                                        u32 width) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + bias[i % width];
}

// Partial column sums: for chunk blockIdx.y of `rows_per_chunk` rows, partial[chunk * width + c]
// is the sum of column c over the chunk. Blocks of (32, 8) threads, 32 columns each.
extern "C" __global__ void p2p_col_sum_partial(const float* x, float* partial, u32 rows,
                                               u32 width, u32 rows_per_chunk) {
    __shared__ float acc[8][33];
    u32 col = blockIdx.x * 32u + threadIdx.x;
    u32 start = blockIdx.y * rows_per_chunk;
    u32 end = min(rows, start + rows_per_chunk);
    float s = 0.0f;
    if (col < width) {
        for (u32 r = start + threadIdx.y; r < end; r += 8u) s += x[(u64)r * width + col];
    }
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < width) {
        float t = 0.0f;
        for (u32 k = 0; k < 8u; ++k) t += acc[k][threadIdx.x];
        partial[(u64)blockIdx.y * width + col] = t;
    }
}

// out[c] = the sum over chunks of partial[chunk * width + c], in chunk order.
extern "C" __global__ void p2p_col_sum_final(const float* partial, float* out, u32 chunks,
                                             u32 width) {
    u32 col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= width) return;
    float t = 0.0f;
    for (u32 k = 0; k < chunks; ++k) t += partial[(u64)k * width + col];
    out[col] = t;
}

// Layer norm of each row (one block per row): (x - mean) * rstd * weight + bias, the biased
// variance as PyTorch's LayerNorm.
extern "C" __global__ void p2p_layer_norm(const float* x, const float* weight, const float* bias,
                                          float* out, u32 rows, u32 width, float eps) {
    __shared__ float shared[32];
    u32 r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + (u64)r * width;
    float* o = out + (u64)r * width;
    float mean, rstd;
    row_moments(row, width, eps, shared, &mean, &rstd);
    for (u32 i = threadIdx.x; i < width; i += blockDim.x)
        o[i] = (row[i] - mean) * rstd * weight[i] + bias[i];
}

// Layer norm's input gradient, one block per row, and each row's mean and rstd into `stats`
// (2 per row) for the weight and bias gradients after it. With x̂ = (x − mean)·rstd and
// ĝ = g·weight: dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)).
extern "C" __global__ void p2p_layer_norm_grad_rows(const float* x, const float* weight,
                                                    const float* grad, float* dx, float* stats,
                                                    u32 rows, u32 width, float eps) {
    __shared__ float shared[32];
    u32 r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + (u64)r * width;
    const float* g = grad + (u64)r * width;
    float* o = dx + (u64)r * width;
    float mean, rstd;
    row_moments(row, width, eps, shared, &mean, &rstd);
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        float gw = g[i] * weight[i];
        sum_g += gw;
        sum_gx += gw * (row[i] - mean) * rstd;
    }
    float mean_g = block_sum(sum_g, shared) / (float)width;
    float mean_gx = block_sum(sum_gx, shared) / (float)width;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        float xh = (row[i] - mean) * rstd;
        o[i] = rstd * (g[i] * weight[i] - mean_g - xh * mean_gx);
    }
    if (threadIdx.x == 0) {
        stats[2u * r] = mean;
        stats[2u * r + 1u] = rstd;
    }
}

// Partial sums of layer norm's weight and bias gradients (g · x̂ and g) per chunk of rows:
// partial[(chunk * 2 + 0) * width + c] and partial[(chunk * 2 + 1) * width + c], so that the
// column sums over 2·width columns (p2p_col_sum_final) are the packed weight row, then the bias
// row. Blocks of (32, 8) threads, 32 columns each.
extern "C" __global__ void p2p_layer_norm_grad_partial(const float* x, const float* grad,
                                                       const float* stats, float* partial,
                                                       u32 rows, u32 width, u32 rows_per_chunk) {
    __shared__ float acc_w[8][33];
    __shared__ float acc_b[8][33];
    u32 col = blockIdx.x * 32u + threadIdx.x;
    u32 start = blockIdx.y * rows_per_chunk;
    u32 end = min(rows, start + rows_per_chunk);
    float sw = 0.0f, sb = 0.0f;
    if (col < width) {
        for (u32 r = start + threadIdx.y; r < end; r += 8u) {
            u64 at = (u64)r * width + col;
            float g = grad[at];
            sw += g * (x[at] - stats[2u * r]) * stats[2u * r + 1u];
            sb += g;
        }
    }
    acc_w[threadIdx.y][threadIdx.x] = sw;
    acc_b[threadIdx.y][threadIdx.x] = sb;
    __syncthreads();
    if (threadIdx.y == 0 && col < width) {
        float tw = 0.0f, tb = 0.0f;
        for (u32 k = 0; k < 8u; ++k) {
            tw += acc_w[k][threadIdx.x];
            tb += acc_b[k][threadIdx.x];
        }
        u64 base = (u64)blockIdx.y * 2u * width;
        partial[base + col] = tw;
        partial[base + width + col] = tb;
    }
}

// RMS norm of each row (one block per row): x · rstd · weight with rstd = 1 / sqrt(mean(x²) +
// eps), as transformers' LlamaRMSNorm in f32.
extern "C" __global__ void p2p_rms_norm(const float* x, const float* weight, float* out, u32 rows,
                                        u32 width, float eps) {
    __shared__ float shared[32];
    u32 r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + (u64)r * width;
    float* o = out + (u64)r * width;
    float q = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) q += row[i] * row[i];
    float rstd = 1.0f / sqrtf(block_sum(q, shared) / (float)width + eps);
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) o[i] = row[i] * rstd * weight[i];
}

// RMS norm's input gradient, one block per row, and each row's rstd into `stats` for the
// weight's gradient after it. With x̂ = x·rstd and ĝ = g·weight: dx = rstd · (ĝ − x̂ · mean(ĝ · x̂)).
extern "C" __global__ void p2p_rms_norm_grad_rows(const float* x, const float* weight,
                                                  const float* grad, float* dx, float* stats,
                                                  u32 rows, u32 width, float eps) {
    __shared__ float shared[32];
    u32 r = blockIdx.x;
    if (r >= rows) return;
    const float* row = x + (u64)r * width;
    const float* g = grad + (u64)r * width;
    float* o = dx + (u64)r * width;
    float q = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) q += row[i] * row[i];
    float rstd = 1.0f / sqrtf(block_sum(q, shared) / (float)width + eps);
    float sum_gx = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) sum_gx += g[i] * weight[i] * row[i] * rstd;
    float mean_gx = block_sum(sum_gx, shared) / (float)width;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x)
        o[i] = rstd * (g[i] * weight[i] - row[i] * rstd * mean_gx);
    if (threadIdx.x == 0) stats[r] = rstd;
}

// Partial sums of RMS norm's weight gradient (g · x̂) per chunk of rows: partial[chunk * width +
// c], summed over the chunks by p2p_col_sum_final. Blocks of (32, 8) threads, 32 columns each.
extern "C" __global__ void p2p_rms_norm_grad_partial(const float* x, const float* grad,
                                                     const float* stats, float* partial, u32 rows,
                                                     u32 width, u32 rows_per_chunk) {
    __shared__ float acc[8][33];
    u32 col = blockIdx.x * 32u + threadIdx.x;
    u32 start = blockIdx.y * rows_per_chunk;
    u32 end = min(rows, start + rows_per_chunk);
    float s = 0.0f;
    if (col < width) {
        for (u32 r = start + threadIdx.y; r < end; r += 8u) {
            u64 at = (u64)r * width + col;
            s += grad[at] * x[at] * stats[r];
        }
    }
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < width) {
        float t = 0.0f;
        for (u32 k = 0; k < 8u; ++k) t += acc[k][threadIdx.x];
        partial[(u64)blockIdx.y * width + col] = t;
    }
}

// SwiGLU's gate: silu(gate) · up.
extern "C" __global__ void p2p_swiglu(const float* gate, const float* up, float* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = gate[i];
        out[i] = v / (1.0f + expf(-v)) * up[i];
    }
}

// SwiGLU's gradients into the two halves of `out` (2·n values): with s = sigmoid(gate), the
// gate's g · up · s · (1 + gate · (1 − s)), then the up projection's g · silu(gate).
extern "C" __global__ void p2p_swiglu_grad(const float* gate, const float* up, const float* g,
                                           float* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float x = gate[i];
        float s = 1.0f / (1.0f + expf(-x));
        out[n + i] = g[i] * x * s;
        out[i] = g[i] * up[i] * s * (1.0f + x * (1.0f - s));
    }
}

// Rotary embeddings in Hugging Face's layout fused with the move between a projection's rows
// and attention's heads: reads x (batch, a, b, head_dim), writes out (batch, b, a, head_dim),
// each head's dimension k < head_dim / 2 turned with k + head_dim / 2 by the angle of its
// position (a's index forward; b's index, and minus the angle, with `back`). One thread per
// pair; cos and sin are (positions, head_dim), each row's halves equal.
extern "C" __global__ void p2p_rotary(const float* x, const float* cos_t, const float* sin_t,
                                      float* out, u32 batch, u32 a, u32 b, u32 head_dim,
                                      u32 back) {
    u32 half = head_dim >> 1;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 total = (u64)batch * a * b * half;
    if (idx >= total) return;
    u32 k = (u32)(idx % half);
    u64 rest = idx / half;
    u32 j = (u32)(rest % b);
    rest /= b;
    u32 i = (u32)(rest % a);
    u64 n = rest / a;
    u32 position = back ? j : i;
    const float* src = x + ((n * a + i) * b + j) * head_dim;
    float* dst = out + ((n * b + j) * a + i) * head_dim;
    float c = cos_t[(u64)position * head_dim + k];
    float s = sin_t[(u64)position * head_dim + k];
    if (back) s = -s;
    float x1 = src[k], x2 = src[k + half];
    dst[k] = x1 * c - x2 * s;
    dst[k + half] = x2 * c + x1 * s;
}

// The causal softmax of scores `(…, time, time)` times `scale`, one warp per row: query i sees
// keys 0..=i (i = row % time), later keys get exactly 0.
extern "C" __global__ void p2p_causal_softmax(const float* x, float* out, u32 rows, u32 time,
                                              float scale) {
    u32 r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u32 lane = threadIdx.x & 31u;
    if (r >= rows) return;
    const float* row = x + (u64)r * time;
    float* y = out + (u64)r * time;
    u32 seen = r % time + 1u;
    float top = NEG_INF;
    for (u32 j = lane; j < seen; j += 32u) top = fmaxf(top, row[j] * scale);
    top = warp_max(top);
    float total = 0.0f;
    for (u32 j = lane; j < seen; j += 32u) {
        float e = expf(row[j] * scale - top);
        y[j] = e;
        total += e;
    }
    total = warp_sum(total);
    for (u32 j = lane; j < time; j += 32u) y[j] = j < seen ? y[j] / total : 0.0f;
}

// Softmax's input gradient per row (one warp per row): scale · y · (g − Σ g·y).
extern "C" __global__ void p2p_softmax_grad(const float* y, const float* g, float* out, u32 rows,
                                            u32 width, float scale) {
    u32 r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u32 lane = threadIdx.x & 31u;
    if (r >= rows) return;
    const float* yr = y + (u64)r * width;
    const float* gr = g + (u64)r * width;
    float* o = out + (u64)r * width;
    float dot = 0.0f;
    for (u32 j = lane; j < width; j += 32u) dot += yr[j] * gr[j];
    dot = warp_sum(dot);
    for (u32 j = lane; j < width; j += 32u) o[j] = scale * yr[j] * (gr[j] - dot);
}

// SiLU, x · sigmoid(x).
extern "C" __global__ void p2p_silu(const float* x, float* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        out[i] = v / (1.0f + expf(-v));
    }
}

// SiLU's input gradient: g · s · (1 + x · (1 − s)), s = sigmoid(x).
extern "C" __global__ void p2p_silu_grad(const float* x, const float* g, float* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        float s = 1.0f / (1.0f + expf(-v));
        out[i] = g[i] * s * (1.0f + v * (1.0f - s));
    }
}

// Each row's cross-entropy against its class index (one warp per row), into `losses`; a
// target outside the classes gives NaN, and its gradient row is NaN too (p2p_cross_entropy_grad),
// so the step's loss and every gradient it reaches are non-finite and the trainer refuses the
// step (the CPU kernel refuses such a target before computing; here that check would cost a
// copy back per step). Data sets check their labels when loaded, so this is a last guard.
extern "C" __global__ void p2p_cross_entropy_rows(const float* logits, const u32* targets,
                                                  float* losses, u32 rows, u32 classes) {
    u32 r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u32 lane = threadIdx.x & 31u;
    if (r >= rows) return;
    const float* row = logits + (u64)r * classes;
    float top = NEG_INF;
    for (u32 j = lane; j < classes; j += 32u) top = fmaxf(top, row[j]);
    top = warp_max(top);
    float total = 0.0f;
    for (u32 j = lane; j < classes; j += 32u) total += expf(row[j] - top);
    total = warp_sum(total);
    if (lane == 0) {
        u32 t = targets[r];
        losses[r] = t < classes ? logf(total) + top - row[t] : NAN_F32;
    }
}

// The mean of `n` values in double precision (as the CPU kernel sums its losses), one block.
extern "C" __global__ void p2p_mean(const float* values, float* out, u32 n) {
    __shared__ double shared[32];
    double s = 0.0;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) s += (double)values[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) shared[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        u32 warps = (blockDim.x + 31u) >> 5;
        for (u32 i = 0; i < warps; ++i) t += shared[i];
        out[0] = n > 0 ? (float)(t / (double)n) : 0.0f;
    }
}

// Cross-entropy's gradient rows (one warp per row): per_row · (softmax − one-hot); NaN for a
// target outside the classes.
extern "C" __global__ void p2p_cross_entropy_grad(const float* logits, const u32* targets,
                                                  float* out, u32 rows, u32 classes,
                                                  float per_row) {
    u32 r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u32 lane = threadIdx.x & 31u;
    if (r >= rows) return;
    const float* row = logits + (u64)r * classes;
    float* o = out + (u64)r * classes;
    float top = NEG_INF;
    for (u32 j = lane; j < classes; j += 32u) top = fmaxf(top, row[j]);
    top = warp_max(top);
    float total = 0.0f;
    for (u32 j = lane; j < classes; j += 32u) total += expf(row[j] - top);
    total = warp_sum(total);
    float scale = per_row / total;
    u32 t = targets[r];
    for (u32 j = lane; j < classes; j += 32u)
        o[j] = t < classes ? expf(row[j] - top) * scale - (j == t ? per_row : 0.0f) : NAN_F32;
}

// AdamW's moment update in place: m = a·m + b·g, or with `squared`, v = a·v + b·g².
extern "C" __global__ void p2p_adam_moment(float* m, const float* g, u64 n, float a, float b,
                                           u32 squared) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float gi = g[i];
        m[i] = a * m[i] + b * (squared ? gi * gi : gi);
    }
}

// AdamW's parameter update in place: p = decay·p − lr·(m·m_scale) / (sqrt(v·v_scale) + eps).
extern "C" __global__ void p2p_adamw_step(float* p, const float* m, const float* v, u64 n,
                                          float lr, float decay, float m_scale, float v_scale,
                                          float eps) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = decay * p[i] - lr * (m[i] * m_scale) / (sqrtf(v[i] * v_scale) + eps);
}

// SGD's momentum buffer in place: v = mu·v + (g + wd·p).
extern "C" __global__ void p2p_sgd_momentum(float* v, const float* g, const float* p, u64 n,
                                            float mu, float wd) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = mu * v[i] + (wd == 0.0f ? g[i] : g[i] + wd * p[i]);
}

// SGD's step in place from the momentum buffer: p −= lr·v, or with Nesterov (nesterov = 1),
// p −= lr·((g + wd·p) + mu·v).
extern "C" __global__ void p2p_sgd_step(float* p, const float* g, const float* v, u64 n, float lr,
                                        float wd, float mu, u32 nesterov) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        if (nesterov) p[i] -= lr * ((g[i] + wd * p[i]) + mu * v[i]);
        else p[i] -= lr * v[i];
    }
}

// Plain SGD in place: p −= lr·(g + wd·p).
extern "C" __global__ void p2p_sgd_plain(float* p, const float* g, u64 n, float lr, float wd) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] -= lr * (g[i] + wd * p[i]);
}
