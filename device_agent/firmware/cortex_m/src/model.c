#include "model.h"

#include "board.h"
#include "error.h"

#include <string.h>

model_t model;

static const char *op_name(poet_v1_McuLayerOp op)
{
    switch (op) {
    case poet_v1_McuLayerOp_MCU_LAYER_OP_INPUT: return "input";
    case poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR: return "linear";
    case poet_v1_McuLayerOp_MCU_LAYER_OP_RELU: return "relu";
    case poet_v1_McuLayerOp_MCU_LAYER_OP_CROSS_ENTROPY: return "cross_entropy";
    default: return "unspecified";
    }
}

bool model_load(const poet_v1_McuModel *spec)
{
    memset(&model, 0, sizeof model);
    uint32_t n = spec->layers_count;
    if (n < 3)
        return fail("model has %lu layers; it needs an input, at least one layer and the loss", (unsigned long)n);
    if (spec->batch_size == 0 || spec->num_classes < 2)
        return fail("model needs batch_size >= 1 and num_classes >= 2 (got %lu, %lu)",
                    (unsigned long)spec->batch_size, (unsigned long)spec->num_classes);
    if (!(spec->learning_rate > 0.0f) || !(spec->momentum >= 0.0f && spec->momentum < 1.0f))
        return fail("model needs learning_rate > 0 and momentum in [0, 1)");
    for (uint32_t i = 0; i < n; i++) {
        const poet_v1_McuLayer *l = &spec->layers[i];
        bool first = i == 0, last = i == n - 1;
        if ((l->op == poet_v1_McuLayerOp_MCU_LAYER_OP_INPUT) != first)
            return fail("layer %lu is %s: the input must be layer 0 and only layer 0", (unsigned long)i,
                        op_name(l->op));
        if ((l->op == poet_v1_McuLayerOp_MCU_LAYER_OP_CROSS_ENTROPY) != last)
            return fail("layer %lu is %s: cross_entropy must be the last layer and only the last",
                        (unsigned long)i, op_name(l->op));
        if (l->op < poet_v1_McuLayerOp_MCU_LAYER_OP_INPUT || l->op > poet_v1_McuLayerOp_MCU_LAYER_OP_CROSS_ENTROPY)
            return fail("layer %lu has an unknown op (%d)", (unsigned long)i, (int)l->op);
        if ((!first && l->in_features == 0) || l->out_features == 0 || l->in_features > 65536 ||
            l->out_features > 65536)
            return fail("layer %lu (%s) has %lu -> %lu features", (unsigned long)i, op_name(l->op),
                        (unsigned long)l->in_features, (unsigned long)l->out_features);
        if (!first && l->in_features != spec->layers[i - 1].out_features)
            return fail("layer %lu (%s) takes %lu features but layer %lu gives %lu", (unsigned long)i,
                        op_name(l->op), (unsigned long)l->in_features, (unsigned long)(i - 1),
                        (unsigned long)spec->layers[i - 1].out_features);
        if (!first && l->op != poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR && l->in_features != l->out_features)
            return fail("layer %lu (%s) must keep its feature count", (unsigned long)i, op_name(l->op));
        model.layers[i] = (layer_t){.op = l->op, .in = l->in_features, .out = l->out_features};
    }
    if (spec->layers[n - 1].out_features != spec->num_classes)
        return fail("the loss has %lu classes, num_classes is %lu", (unsigned long)spec->layers[n - 1].out_features,
                    (unsigned long)spec->num_classes);
    for (uint32_t i = 0; i < spec->node_layer_count; i++)
        if (spec->node_layer[i] >= n)
            return fail("node %lu maps to layer %lu; the model has %lu", (unsigned long)i,
                        (unsigned long)spec->node_layer[i], (unsigned long)n);

    /* Parameters: per Linear layer weight, bias, their gradients, their momentum buffers. */
    float *cursor = (float *)board_config.params;
    uint64_t floats = 0;
    for (uint32_t i = 0; i < n; i++)
        if (model.layers[i].op == poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR)
            floats += 3ull * ((uint64_t)model.layers[i].in * model.layers[i].out + model.layers[i].out);
    if (floats * 4u > board_config.param_bytes)
        return fail("parameters, gradients and momentum need %llu bytes; the param region has %lu",
                    (unsigned long long)(floats * 4u), (unsigned long)board_config.param_bytes);
    for (uint32_t i = 0; i < n; i++) {
        layer_t *l = &model.layers[i];
        if (l->op != poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR)
            continue;
        uint32_t wn = l->in * l->out;
        float **slots[6] = {&l->w, &l->b, &l->gw, &l->gb, &l->mw, &l->mb};
        for (int s = 0; s < 6; s++) {
            *slots[s] = cursor;
            cursor += (s % 2 == 0) ? wn : l->out;
        }
    }
    memset(board_config.params, 0, (size_t)floats * 4u);
    model.param_bytes_used = (uint32_t)(floats * 4u);

    uint64_t input_bytes = 4ull * spec->batch_size * spec->layers[0].out_features;
    uint64_t label_bytes = 4ull * spec->batch_size;
    if (input_bytes + label_bytes > board_config.batch_bytes)
        return fail("a batch needs %llu bytes; the batch region has %lu",
                    (unsigned long long)(input_bytes + label_bytes), (unsigned long)board_config.batch_bytes);
    model.inputs = (float *)board_config.batch;
    model.labels = (uint32_t *)(board_config.batch + input_bytes);

    model.layer_count = n;
    model.node_count = spec->node_layer_count;
    for (uint32_t i = 0; i < spec->node_layer_count; i++)
        model.node_layer[i] = (uint8_t)spec->node_layer[i];
    model.batch = spec->batch_size;
    model.features = spec->layers[0].out_features;
    model.classes = spec->num_classes;
    model.lr = spec->learning_rate;
    model.momentum = spec->momentum;
    model.loaded = true;
    return true;
}

bool model_param_tensor(uint32_t layer, uint32_t tensor, float **data, uint32_t *count)
{
    if (!model.loaded)
        return fail("no model loaded");
    if (layer >= model.layer_count || model.layers[layer].op != poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR)
        return fail("layer %lu has no parameters", (unsigned long)layer);
    if (tensor > 1)
        return fail("tensor %lu: a linear layer has tensor 0 (weight) and 1 (bias)", (unsigned long)tensor);
    const layer_t *l = &model.layers[layer];
    *data = tensor == 0 ? l->w : l->b;
    *count = tensor == 0 ? l->in * l->out : l->out;
    return true;
}

bool model_write_params(uint32_t layer, uint32_t tensor, uint32_t offset, const uint8_t *data, uint32_t bytes)
{
    float *dst;
    uint32_t count;
    if (!model_param_tensor(layer, tensor, &dst, &count))
        return false;
    if (bytes % 4u != 0)
        return fail("parameter chunk of %lu bytes is not whole float32s", (unsigned long)bytes);
    if (offset > count || bytes / 4u > count - offset)
        return fail("parameter chunk [%lu, +%lu) is beyond layer %lu tensor %lu's %lu elements",
                    (unsigned long)offset, (unsigned long)(bytes / 4u), (unsigned long)layer, (unsigned long)tensor,
                    (unsigned long)count);
    memcpy(dst + offset, data, bytes);
    return true;
}

bool model_batch_chunk(uint32_t offset, const uint8_t *inputs, uint32_t bytes, const uint32_t *labels,
                       uint32_t label_count)
{
    if (!model.loaded)
        return fail("no model loaded");
    uint32_t total = model.batch * model.features;
    if (offset == 0) {
        model.inputs_received = 0;
        model.labels_received = false;
        if (label_count != model.batch)
            return fail("the batch chunk at offset 0 carries %lu labels; the batch has %lu",
                        (unsigned long)label_count, (unsigned long)model.batch);
        for (uint32_t i = 0; i < label_count; i++)
            if (labels[i] >= model.classes)
                return fail("label %lu is class %lu; the model has %lu classes", (unsigned long)i,
                            (unsigned long)labels[i], (unsigned long)model.classes);
        memcpy(model.labels, labels, label_count * 4u);
        model.labels_received = true;
    } else if (label_count) {
        return fail("labels come with the batch chunk at offset 0");
    }
    if (offset != model.inputs_received)
        return fail("batch chunk at offset %lu; the next expected is %lu", (unsigned long)offset,
                    (unsigned long)model.inputs_received);
    if (bytes % 4u != 0 || bytes / 4u > total - offset)
        return fail("batch chunk of %lu bytes at offset %lu overruns the %lu input elements", (unsigned long)bytes,
                    (unsigned long)offset, (unsigned long)total);
    memcpy(model.inputs + offset, inputs, bytes);
    model.inputs_received += bytes / 4u;
    return true;
}

bool model_batch_ready(void)
{
    return model.loaded && model.labels_received && model.inputs_received == model.batch * model.features;
}

void model_zero_grads(void)
{
    for (uint32_t i = 0; i < model.layer_count; i++) {
        layer_t *l = &model.layers[i];
        if (l->op != poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR)
            continue;
        memset(l->gw, 0, (size_t)l->in * l->out * 4u);
        memset(l->gb, 0, (size_t)l->out * 4u);
    }
}

/* torch.optim.SGD (no weight decay, dampening or Nesterov): buf = grad on the first step, then
 * buf = momentum * buf + grad; p = p - lr * buf. With momentum 0: p = p - lr * grad. */
static void sgd(float *p, const float *g, float *buf, uint32_t count)
{
    const float lr = model.lr, m = model.momentum;
    for (uint32_t j = 0; j < count; j++) {
        float d = g[j];
        if (m != 0.0f) {
            if (model.momentum_started) {
                float scaled = buf[j] * m;
                buf[j] = scaled + d;
            } else {
                buf[j] = d;
            }
            d = buf[j];
        }
        float step = -lr * d;
        p[j] = p[j] + step;
    }
}

void model_sgd_step(void)
{
    for (uint32_t i = 0; i < model.layer_count; i++) {
        layer_t *l = &model.layers[i];
        if (l->op != poet_v1_McuLayerOp_MCU_LAYER_OP_LINEAR)
            continue;
        sgd(l->w, l->gw, l->mw, l->in * l->out);
        sgd(l->b, l->gb, l->mb, l->out);
    }
    model.momentum_started = true;
}
