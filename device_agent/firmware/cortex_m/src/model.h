/* The network (McuModel), its parameters in the board's param region, and the training batch. */
#ifndef POET_MODEL_H
#define POET_MODEL_H

#include "poet/v1/mcu.pb.h"

#include <stdbool.h>
#include <stdint.h>

#define MODEL_MAX_LAYERS 16u  /* McuModel.layers max_count (mcu.options) */
#define MODEL_MAX_NODES 64u   /* McuModel.node_layer and Schedule.nodes max_count */

typedef struct {
    poet_v1_McuLayerOp op;
    uint32_t in, out;
    float *w, *b;    /* Linear only: weight [out, in] and bias [out] */
    float *gw, *gb;  /* their gradients, written by the layer's backward node */
    float *mw, *mb;  /* momentum buffers */
} layer_t;

typedef struct {
    bool loaded;
    uint32_t layer_count;
    layer_t layers[MODEL_MAX_LAYERS];
    uint32_t node_count;
    uint8_t node_layer[MODEL_MAX_NODES];
    uint32_t batch, features, classes;
    float lr, momentum;
    bool momentum_started;  /* torch keeps no buffer before the first step: buf = grad then */
    float *inputs;          /* [batch, features], in the board's batch region */
    uint32_t *labels;       /* [batch] */
    uint32_t inputs_received;
    bool labels_received;
    uint32_t param_bytes_used;
} model_t;

extern model_t model;

bool model_load(const poet_v1_McuModel *spec);
bool model_param_tensor(uint32_t layer, uint32_t tensor, float **data, uint32_t *count);
bool model_write_params(uint32_t layer, uint32_t tensor, uint32_t offset, const uint8_t *data, uint32_t bytes);
bool model_batch_chunk(uint32_t offset, const uint8_t *inputs, uint32_t bytes, const uint32_t *labels,
                       uint32_t label_count);
bool model_batch_ready(void);
void model_zero_grads(void);
void model_sgd_step(void);

#endif
