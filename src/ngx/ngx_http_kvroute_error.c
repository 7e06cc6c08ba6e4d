
/*
 * Copyright (C) kvroute authors
 *
 * The responses kvroute itself produces, in the OpenAI API's error shape,
 * {"error": {"message", "type", "param", "code"}}, so that OpenAI clients
 * read them as errors rather than failing on an HTML page. Errors nginx
 * produces (413, 502, 504) are given the same shape by configuration
 * (error_page, docs/CONFIG.md "OpenAI-shaped errors").
 */


#include "ngx_http_kvroute.h"


/*
 * Every usable server is over its busy threshold: 503 with Retry-After, as
 * OpenAI answers when it is overloaded. Called from a phase handler, whose
 * return value this is: the response is sent and the request finalized here.
 */

ngx_int_t
ngx_http_kvroute_busy(ngx_http_request_t *r, ngx_uint_t retry_after)
{
    ngx_int_t         rc;
    ngx_table_elt_t  *h;

    static ngx_str_t  body = ngx_string(
        "{\"error\":{\"message\":\"Every inference server is busy; "
        "retry after the time in the Retry-After header.\","
        "\"type\":\"server_error\",\"param\":null,"
        "\"code\":\"server_busy\"}}\n");

    h = ngx_list_push(&r->headers_out.headers);
    if (h == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }

    h->hash = 1;
#if (nginx_version >= 1023000)
    h->next = NULL;
#endif
    ngx_str_set(&h->key, "Retry-After");
    h->value.data = ngx_pnalloc(r->pool, NGX_INT_T_LEN);
    if (h->value.data == NULL) {
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    }
    h->value.len = ngx_sprintf(h->value.data, "%ui", retry_after)
                   - h->value.data;

    rc = ngx_http_kvroute_send_json(r, NGX_HTTP_SERVICE_UNAVAILABLE, &body);

    ngx_http_finalize_request(r, rc);

    return NGX_DONE;
}


/*
 * A model that no upstream of the location serves ("kvroute_upstream A B
 * ...", kvroute_models): 404, as OpenAI and vLLM answer it. Returns what
 * sending gave, as a content handler does; the caller finalizes.
 */

ngx_int_t
ngx_http_kvroute_model_not_found(ngx_http_request_t *r)
{
    static ngx_str_t  body = ngx_string(
        "{\"error\":{\"message\":\"The model named in the request is not "
        "served here.\",\"type\":\"invalid_request_error\","
        "\"param\":\"model\",\"code\":\"model_not_found\"}}\n");

    return ngx_http_kvroute_send_json(r, NGX_HTTP_NOT_FOUND, &body);
}


/* A JSON response with this status and body (not copied: it must live as
 * long as the request); returns what sending gave. */

ngx_int_t
ngx_http_kvroute_send_json(ngx_http_request_t *r, ngx_uint_t status,
    ngx_str_t *body)
{
    ngx_int_t     rc;
    ngx_buf_t    *b;
    ngx_chain_t   out;

    r->headers_out.status = status;
    r->headers_out.content_length_n = body->len;
    ngx_str_set(&r->headers_out.content_type, "application/json");
    r->headers_out.content_type_len = r->headers_out.content_type.len;
    r->headers_out.content_type_lowcase = NULL;

    rc = ngx_http_send_header(r);

    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only) {
        return rc;
    }

    b = ngx_calloc_buf(r->pool);
    if (b == NULL) {
        return NGX_ERROR;
    }

    b->pos = body->data;
    b->last = body->data + body->len;
    b->memory = 1;
    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;

    out.buf = b;
    out.next = NULL;

    return ngx_http_output_filter(r, &out);
}
