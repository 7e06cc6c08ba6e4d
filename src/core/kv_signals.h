/*
 * Threads inherit the signal mask of the thread that creates them. A library
 * that starts threads inside a host process (cnats and libzmq inside an
 * nginx helper) blocks every signal around their creation, so that the
 * host's own thread alone takes SIGTERM, SIGHUP and the rest.
 */
#ifndef KV_SIGNALS_H
#define KV_SIGNALS_H

#include <pthread.h>
#include <signal.h>

static inline void kv_signals_block(sigset_t *old)
{
    sigset_t  all;

    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, old);
}

static inline void kv_signals_restore(const sigset_t *old)
{
    pthread_sigmask(SIG_SETMASK, old, NULL);
}

#endif
