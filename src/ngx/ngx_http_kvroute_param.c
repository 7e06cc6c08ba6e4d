
/*
 * Copyright (C) kvroute authors
 *
 * "name=value" parameters of the kvroute directives, one way for all of
 * them: a directive lists its parameters in a table (name with its "=", the
 * field it sets as an offset into its configuration, the type and range),
 * sets their defaults where its configuration is created, and hands every
 * argument to ngx_http_kvroute_param_set(). Parameters whose value is more
 * than a number, a size, a time or one of a few names (a file, a variable,
 * a URL) are matched with ngx_http_kvroute_param_is() and handled by the
 * directive itself.
 */


#include "ngx_http_kvroute.h"


ngx_uint_t
ngx_http_kvroute_param_match(ngx_str_t *v, u_char *name, size_t len,
    ngx_str_t *value)
{
    if (v->len <= len || ngx_strncmp(v->data, name, len) != 0) {
        return 0;
    }

    value->data = v->data + len;
    value->len = v->len - len;

    return 1;
}


static ngx_int_t ngx_http_kvroute_param_invalid(ngx_conf_t *cf,
    const char *directive, ngx_http_kvroute_param_t *p, ngx_str_t *v);


/* NGX_OK: v is one of the table's and is set; NGX_DECLINED: it is not one
 * of them; NGX_ERROR: it is, with a bad value (logged). */

ngx_int_t
ngx_http_kvroute_param_set(ngx_conf_t *cf, const char *directive,
    ngx_http_kvroute_param_t *table, void *conf, ngx_str_t *v)
{
    char                      *end;
    u_char                     buf[64], *field;
    double                     d;
    ssize_t                    size;
    ngx_int_t                  n;
    ngx_str_t                  s;
    ngx_msec_t                 ms;
    ngx_conf_enum_t           *e;
    ngx_http_kvroute_param_t  *p;

    for (p = table; p->name.len; p++) {
        if (ngx_http_kvroute_param_match(v, p->name.data, p->name.len, &s)) {
            break;
        }
    }

    if (p->name.len == 0) {
        return NGX_DECLINED;
    }

    field = (u_char *) conf + p->offset;

    switch (p->type) {

    case NGX_HTTP_KVROUTE_P_DOUBLE:
        if (s.len >= sizeof(buf)) {
            goto invalid;
        }

        ngx_memcpy(buf, s.data, s.len);
        buf[s.len] = '\0';

        d = strtod((char *) buf, &end);

        if (*end != '\0' || !(d >= p->min && d <= p->max)) {
            goto invalid;
        }

        *(double *) field = d;
        break;

    case NGX_HTTP_KVROUTE_P_SIZE:
        size = ngx_parse_size(&s);
        if (size == NGX_ERROR || size < p->min || size > p->max) {
            goto invalid;
        }

        *(size_t *) field = size;
        break;

    case NGX_HTTP_KVROUTE_P_MSEC:
    case NGX_HTTP_KVROUTE_P_MS32:
        ms = ngx_parse_time(&s, 0);
        if (ms == (ngx_msec_t) NGX_ERROR || ms < p->min || ms > p->max) {
            goto invalid;
        }

        if (p->type == NGX_HTTP_KVROUTE_P_MSEC) {
            *(ngx_msec_t *) field = ms;

        } else {
            *(uint32_t *) field = (uint32_t) ms;
        }

        break;

    case NGX_HTTP_KVROUTE_P_ENUM:
        for (e = p->names; e->name.len; e++) {
            if (e->name.len == s.len
                && ngx_strncmp(e->name.data, s.data, s.len) == 0)
            {
                *(int *) field = (int) e->value;
                return NGX_OK;
            }
        }

        goto invalid;

    default:
        n = ngx_atoi(s.data, s.len);
        if (n == NGX_ERROR || n < p->min || n > p->max) {
            goto invalid;
        }

        if (p->type == NGX_HTTP_KVROUTE_P_UINT) {
            *(ngx_uint_t *) field = n;

        } else {
            *(uint64_t *) field = n;
        }
    }

    return NGX_OK;

invalid:

    return ngx_http_kvroute_param_invalid(cf, directive, p, v);
}


static ngx_int_t
ngx_http_kvroute_param_invalid(ngx_conf_t *cf, const char *directive,
    ngx_http_kvroute_param_t *p, ngx_str_t *v)
{
    u_char           names[256], *b, *last;
    ngx_conf_enum_t *e;

    switch (p->type) {

    case NGX_HTTP_KVROUTE_P_ENUM:
        b = names;
        last = names + sizeof(names) - 1;

        for (e = p->names; e->name.len; e++) {
            b = ngx_slprintf(b, last, "%s%V%V", e == p->names ? "" : " or ",
                             &p->name, &e->name);
        }

        *b = '\0';

        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid \"%V\" in \"%s\": expected %s", v,
                           directive, names);
        break;

    case NGX_HTTP_KVROUTE_P_MSEC:
    case NGX_HTTP_KVROUTE_P_MS32:
        if (p->max < 1e15) {
            ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                               "invalid parameter \"%V\" in \"%s\": expected a "
                               "time%s up to %.0fs (e.g. 500ms, 30s)", v,
                               directive, p->min > 0 ? " above 0" : "",
                               p->max / 1000);
            break;
        }

        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid parameter \"%V\" in \"%s\": expected a "
                           "time%s (e.g. 500ms, 30s)", v, directive,
                           p->min > 0 ? " above 0" : "");
        break;

    case NGX_HTTP_KVROUTE_P_DOUBLE:
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid parameter \"%V\" in \"%s\": expected a "
                           "number in [%.3f, %.0f]", v, directive, p->min,
                           p->max);
        break;

    default:
        ngx_conf_log_error(NGX_LOG_EMERG, cf, 0,
                           "invalid parameter \"%V\" in \"%s\": expected a "
                           "whole number in [%.0f, %.0f]", v, directive,
                           p->min, p->max);
    }

    return NGX_ERROR;
}


/* A parameter's value as a C string (cnats and the ingester take those). */

char *
ngx_http_kvroute_param_cstr(ngx_conf_t *cf, ngx_str_t *s, const char **out)
{
    u_char  *p;

    p = ngx_pnalloc(cf->pool, s->len + 1);
    if (p == NULL) {
        return NGX_CONF_ERROR;
    }

    ngx_memcpy(p, s->data, s->len);
    p[s->len] = '\0';
    *out = (const char *) p;

    return NGX_CONF_OK;
}
