#include "ops.h"

#include <math.h>

void linear_forward(const float *x, const float *w, const float *b, float *y, uint32_t batch, uint32_t in,
                    uint32_t out)
{
    for (uint32_t i = 0; i < batch; i++) {
        const float *xi = x + (uint64_t)i * in;
        for (uint32_t o = 0; o < out; o++) {
            const float *wo = w + (uint64_t)o * in;
            float acc = 0.0f;
            for (uint32_t k = 0; k < in; k++)
                acc += xi[k] * wo[k];
            y[(uint64_t)i * out + o] = acc + b[o];
        }
    }
}

void linear_backward(const float *g, const float *x, const float *w, float *grad_x, float *grad_w, float *grad_b,
                     uint32_t batch, uint32_t in, uint32_t out)
{
    if (grad_x) {
        for (uint32_t i = 0; i < batch; i++) {
            float *gx = grad_x + (uint64_t)i * in;
            for (uint32_t k = 0; k < in; k++)
                gx[k] = 0.0f;
            for (uint32_t o = 0; o < out; o++) {
                float gio = g[(uint64_t)i * out + o];
                const float *wo = w + (uint64_t)o * in;
                for (uint32_t k = 0; k < in; k++)
                    gx[k] += gio * wo[k];
            }
        }
    }
    for (uint32_t j = 0; j < out * in; j++)
        grad_w[j] = 0.0f;
    for (uint32_t o = 0; o < out; o++)
        grad_b[o] = 0.0f;
    for (uint32_t i = 0; i < batch; i++) {
        const float *xi = x + (uint64_t)i * in;
        for (uint32_t o = 0; o < out; o++) {
            float gio = g[(uint64_t)i * out + o];
            float *gw = grad_w + (uint64_t)o * in;
            for (uint32_t k = 0; k < in; k++)
                gw[k] += gio * xi[k];
            grad_b[o] += gio;
        }
    }
}

void relu_forward(const float *x, float *y, uint32_t count)
{
    for (uint32_t j = 0; j < count; j++)
        y[j] = x[j] > 0.0f ? x[j] : 0.0f;
}

void relu_backward(const float *g, const float *y, float *grad_x, uint32_t count)
{
    for (uint32_t j = 0; j < count; j++)
        grad_x[j] = y[j] > 0.0f ? g[j] : 0.0f;
}

float cross_entropy_forward(const float *logits, const uint32_t *labels, float *probs, uint32_t batch,
                            uint32_t classes)
{
    float total = 0.0f;
    for (uint32_t i = 0; i < batch; i++) {
        const float *row = logits + (uint64_t)i * classes;
        float *p = probs + (uint64_t)i * classes;
        float max = row[0];
        for (uint32_t c = 1; c < classes; c++)
            if (row[c] > max)
                max = row[c];
        float sum = 0.0f;
        for (uint32_t c = 0; c < classes; c++) {
            p[c] = expf(row[c] - max);
            sum += p[c];
        }
        for (uint32_t c = 0; c < classes; c++)
            p[c] = p[c] / sum;
        total += (max + logf(sum)) - row[labels[i]];
    }
    return total / (float)batch;
}

void cross_entropy_backward(const float *probs, const uint32_t *labels, float *grad_logits, uint32_t batch,
                            uint32_t classes)
{
    for (uint32_t i = 0; i < batch; i++) {
        const float *p = probs + (uint64_t)i * classes;
        float *g = grad_logits + (uint64_t)i * classes;
        for (uint32_t c = 0; c < classes; c++)
            g[c] = (p[c] - (c == labels[i] ? 1.0f : 0.0f)) / (float)batch;
    }
}
