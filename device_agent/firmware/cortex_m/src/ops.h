/* fp32 training kernels, in the layouts torch uses: activations [batch, features] row-major,
 * Linear weight [out_features, in_features]. Built with -ffp-contract=off: every product and sum
 * is rounded as written (no fused multiply-add), as torch's CPU kernels round them. */
#ifndef POET_OPS_H
#define POET_OPS_H

#include <stdint.h>

/* y = x W^T + b */
void linear_forward(const float *x, const float *w, const float *b, float *y, uint32_t batch, uint32_t in,
                    uint32_t out);
/* grad_x = g W (skipped when grad_x is NULL), grad_w = g^T x, grad_b = sum of g over the batch */
void linear_backward(const float *g, const float *x, const float *w, float *grad_x, float *grad_w, float *grad_b,
                     uint32_t batch, uint32_t in, uint32_t out);
void relu_forward(const float *x, float *y, uint32_t count);
/* torch's threshold_backward(g, y, 0): g where the saved output y > 0, else 0 */
void relu_backward(const float *g, const float *y, float *grad_x, uint32_t count);
/* Softmax cross-entropy, mean over the batch: probs [batch, classes] and returns the loss.
 * Stable: each row's max is subtracted before exp; loss_i = logsumexp(row) - row[label]. */
float cross_entropy_forward(const float *logits, const uint32_t *labels, float *probs, uint32_t batch,
                            uint32_t classes);
/* grad_logits = (probs - onehot(labels)) / batch */
void cross_entropy_backward(const float *probs, const uint32_t *labels, float *grad_logits, uint32_t batch,
                            uint32_t classes);

#endif
