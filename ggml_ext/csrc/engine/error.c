// Errors go to a caller-provided buffer (truncated to fit): nothing in the engine aborts on bad input.
#include <stdarg.h>
#include <stdio.h>

#include "engine.h"

void dg_set_err(char *err, size_t err_len, const char *fmt, ...) {
    if (err == NULL || err_len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}
