/* The paced upstream of perf/gateway.py's native mode: an OpenAI-compatible chat server that answers every
 * `POST /v1/chat/completions` asking `"stream": true` with an SSE stream of EVENTS content chunks, one every
 * 1/RATE s, then a usage chunk and `data: [DONE]`; a request without it gets one chat completion (JSON, with
 * `usage`). A request's `max_tokens`, when given, is its number of content chunks (tokens) instead of EVENTS. `GET /health` answers 200 (the node agent's probe), `GET /v1/models` the one model.
 *
 * The wire shapes are the OpenAI API reference's (Chat Completions, "The chat completion chunk object" and
 * "stream_options.include_usage": chunks of `object` "chat.completion.chunk" with `choices[].delta`, the last
 * content chunk with `finish_reason` "stop", then one chunk with `"choices": []` and `usage`, then
 * `data: [DONE]`), as vLLM's OpenAI server writes them (vllm/entrypoints/openai/serving_chat.py,
 * chat_completion_stream_generator: the first delta carries `"role": "assistant"`, every chunk has
 * `"logprobs": null`, each event is `data: <json>\n\n` in its own HTTP/1.1 chunk of a keep-alive
 * `Transfer-Encoding: chunked` answer).
 *
 * One thread, epoll, non-blocking sockets; the streams' next events wait on a timer wheel of 1 ms slots
 * (no thread and no timer per stream): the loop sleeps until the next slot that holds a stream, and writes
 * every event due up to then. Event i of a stream is due at its start + i/RATE s (no drift).
 *
 *   paced_upstream HOST PORT EVENTS RATE
 *
 * prints `listening HOST:PORT` once it accepts; on SIGTERM or SIGINT it prints one JSON line,
 * {"streams": answers streamed to their end, "events": SSE events written (data: lines), "unary": ...},
 * and exits 0. Built by perf/native.py with the system's C compiler. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define IN_CAP 65536
#define TICK_NS 1000000LL /* one wheel slot: 1 ms */
#define WHEEL 8192        /* slots: 8.2 s ahead, more than any interval between two events */
#define MAX_EVENTS 512
#define SCAN_SLOTS 1000   /* the loop looks this far ahead for the next stream due (then wakes anyway) */

typedef struct conn {
    int fd;
    char in[IN_CAP];
    size_t inlen;
    char *out;
    size_t outlen, outoff, outcap;
    int want_out; /* EPOLLOUT registered */
    /* the stream being answered, if any */
    int streaming;
    int sent;      /* content chunks written */
    int events;    /* content chunks to write: max_tokens, else EVENTS */
    int64_t start; /* ns */
    int64_t due;   /* tick of the next event */
    long id;
    char model[128];
    struct conn *wnext, *wprev; /* its wheel slot's list, while streaming */
} conn;

static int events_per_stream;
static double rate;
static conn *wheel[WHEEL];
static int64_t last_tick;
static int active_streams;
static long next_id;
static long long n_streams, n_events, n_unary;
static volatile sig_atomic_t stopping;
static int epfd;
static const char *host_name;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void on_signal(int sig) {
    (void)sig;
    stopping = 1;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

static void out_append(conn *c, const char *data, size_t len) {
    if (c->outlen + len > c->outcap) {
        size_t cap = c->outcap ? c->outcap : 4096;
        while (cap < c->outlen + len) cap *= 2;
        char *grown = realloc(c->out, cap);
        if (!grown) die("realloc");
        c->out = grown;
        c->outcap = cap;
    }
    memcpy(c->out + c->outlen, data, len);
    c->outlen += len;
}

static void wheel_add(conn *c) {
    conn **slot = &wheel[c->due % WHEEL];
    c->wprev = NULL;
    c->wnext = *slot;
    if (*slot) (*slot)->wprev = c;
    *slot = c;
}

static void wheel_remove(conn *c) {
    if (c->wprev)
        c->wprev->wnext = c->wnext;
    else
        wheel[c->due % WHEEL] = c->wnext;
    if (c->wnext) c->wnext->wprev = c->wprev;
    c->wnext = c->wprev = NULL;
}

static void close_conn(conn *c) {
    if (c->streaming) {
        wheel_remove(c);
        active_streams--;
    }
    close(c->fd); /* also leaves the epoll set */
    free(c->out);
    free(c);
}

static void set_out_interest(conn *c, int want) {
    if (c->want_out == want) return;
    struct epoll_event ev = {.events = EPOLLIN | (want ? EPOLLOUT : 0), .data.ptr = c};
    if (epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev) < 0) die("epoll_ctl");
    c->want_out = want;
}

/* Writes what is buffered; 0 when the connection failed (the caller closes it). */
static int flush(conn *c) {
    while (c->outoff < c->outlen) {
        ssize_t n = write(c->fd, c->out + c->outoff, c->outlen - c->outoff);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                set_out_interest(c, 1);
                return 1;
            }
            return 0;
        }
        c->outoff += (size_t)n;
    }
    c->outoff = c->outlen = 0;
    set_out_interest(c, 0);
    return 1;
}

/* One SSE event `data: <payload>\n\n` as one HTTP/1.1 chunk. */
static void write_event(conn *c, const char *payload, int len) {
    char head[32];
    int hl = snprintf(head, sizeof head, "%x\r\n", len + 8);
    out_append(c, head, (size_t)hl);
    out_append(c, "data: ", 6);
    out_append(c, payload, (size_t)len);
    out_append(c, "\n\n\r\n", 4);
    n_events++;
}

/* The next content chunk; after the last one the usage chunk, [DONE] and the chunked body's end. */
static void emit(conn *c) {
    char buf[1024];
    int last = c->sent == c->events - 1;
    int n = snprintf(buf, sizeof buf,
                     "{\"id\":\"chatcmpl-perf-%ld\",\"object\":\"chat.completion.chunk\",\"created\":%ld,"
                     "\"model\":\"%s\",\"choices\":[{\"index\":0,\"delta\":{%s\"content\":\"tok \"},"
                     "\"logprobs\":null,\"finish_reason\":%s}]}",
                     c->id, (long)time(NULL), c->model, c->sent == 0 ? "\"role\":\"assistant\"," : "",
                     last ? "\"stop\"" : "null");
    write_event(c, buf, n);
    c->sent++;
    if (!last) return;
    n = snprintf(buf, sizeof buf,
                 "{\"id\":\"chatcmpl-perf-%ld\",\"object\":\"chat.completion.chunk\",\"created\":%ld,"
                 "\"model\":\"%s\",\"choices\":[],\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":%d,"
                 "\"total_tokens\":%d}}",
                 c->id, (long)time(NULL), c->model, c->events, 8 + c->events);
    write_event(c, buf, n);
    write_event(c, "[DONE]", 6);
    out_append(c, "0\r\n\r\n", 5);
    n_streams++;
}

static int64_t due_tick(conn *c) {
    return (c->start + (int64_t)((double)c->sent * 1e9 / rate)) / TICK_NS;
}

/* The model the request names, when it is a plain name; else "perf". */
static void request_model(const char *body, size_t len, char *out, size_t cap) {
    strcpy(out, "perf");
    const char *p = memmem(body, len, "\"model\"", 7);
    if (!p) return;
    const char *end = body + len;
    p += 7;
    while (p < end && (*p == ' ' || *p == ':')) p++;
    if (p >= end || *p != '"') return;
    p++;
    size_t i = 0;
    while (p < end && *p != '"' && i + 1 < cap) {
        char ch = *p++;
        int plain = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                    strchr("-_.:/@", ch);
        if (!plain) return;
        out[i++] = ch;
    }
    if (p >= end || *p != '"' || i == 0) return;
    out[i] = 0;
}

static int asks_stream(const char *body, size_t len) {
    const char *p = memmem(body, len, "\"stream\"", 8);
    if (!p) return 0;
    const char *end = body + len;
    p += 8;
    while (p < end && (*p == ' ' || *p == ':')) p++;
    return end - p >= 4 && memcmp(p, "true", 4) == 0;
}

/* The request's `max_tokens` when it is a positive integer (at most MAX_TOKENS), else EVENTS. */
#define MAX_TOKENS 100000
static int request_events(const char *body, size_t len) {
    const char *p = memmem(body, len, "\"max_tokens\"", 12);
    if (!p) return events_per_stream;
    const char *end = body + len;
    p += 12;
    while (p < end && (*p == ' ' || *p == ':')) p++;
    long n = 0;
    int digits = 0;
    while (p < end && *p >= '0' && *p <= '9' && n <= MAX_TOKENS) n = n * 10 + (*p++ - '0'), digits++;
    return digits && n > 0 && n <= MAX_TOKENS ? (int)n : events_per_stream;
}

static void answer_plain(conn *c, const char *status, const char *ctype, const char *body) {
    char head[256];
    int n = snprintf(head, sizeof head, "HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n\r\n", status,
                     ctype, strlen(body));
    out_append(c, head, (size_t)n);
    out_append(c, body, strlen(body));
}

static void answer_unary(conn *c) {
    char body[1024];
    char content[512] = "";
    size_t off = 0;
    int tokens = 0;
    for (; tokens < c->events && off + 5 < sizeof content; tokens++)
        off += (size_t)sprintf(content + off, "%stok", tokens ? " " : "");
    snprintf(body, sizeof body,
             "{\"id\":\"chatcmpl-perf-%ld\",\"object\":\"chat.completion\",\"created\":%ld,\"model\":\"%s\","
             "\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"%s\"},"
             "\"logprobs\":null,\"finish_reason\":\"stop\"}],"
             "\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":%d,\"total_tokens\":%d}}",
             c->id, (long)time(NULL), c->model, content, tokens, 8 + tokens);
    answer_plain(c, "200 OK", "application/json", body);
    n_unary++;
}

/* Handles every whole request buffered (one at a time: a stream's connection waits until its end). */
static int handle_requests(conn *c) {
    while (!c->streaming) {
        char *end = memmem(c->in, c->inlen, "\r\n\r\n", 4);
        if (!end) return c->inlen < IN_CAP;
        size_t head_len = (size_t)(end - c->in) + 4;
        size_t body_len = 0;
        for (char *line = memchr(c->in, '\n', head_len); line && line < end; line = memchr(line, '\n', (size_t)(end - line))) {
            line++;
            if (strncasecmp(line, "content-length:", 15) == 0) body_len = strtoul(line + 15, NULL, 10);
        }
        if (head_len + body_len > IN_CAP) return 0;
        if (c->inlen < head_len + body_len) return 1;
        const char *body = c->in + head_len;
        c->id = next_id++;
        if (strncmp(c->in, "POST /v1/chat/completions ", 26) == 0) {
            request_model(body, body_len, c->model, sizeof c->model);
            c->events = request_events(body, body_len);
            if (asks_stream(body, body_len)) {
                static const char head[] =
                    "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n";
                out_append(c, head, sizeof head - 1);
                c->sent = 0;
                c->start = now_ns();
                if (!active_streams) last_tick = c->start / TICK_NS; /* the wheel idled: nothing to catch up */
                emit(c); /* the first event at once */
                if (c->sent < c->events) {
                    c->streaming = 1;
                    active_streams++;
                    c->due = due_tick(c);
                    if (c->due <= last_tick) c->due = last_tick + 1;
                    wheel_add(c);
                }
            } else {
                answer_unary(c);
            }
        } else if (strncmp(c->in, "GET /health ", 12) == 0) {
            answer_plain(c, "200 OK", "text/plain", "ok");
        } else if (strncmp(c->in, "GET /v1/models ", 15) == 0) {
            answer_plain(c, "200 OK", "application/json",
                         "{\"object\":\"list\",\"data\":[{\"id\":\"perf\",\"object\":\"model\",\"created\":0,"
                         "\"owned_by\":\"perf\"}]}");
        } else {
            answer_plain(c, "404 Not Found", "application/json", "{\"error\":{\"message\":\"not found\"}}");
        }
        memmove(c->in, c->in + head_len + body_len, c->inlen - head_len - body_len);
        c->inlen -= head_len + body_len;
    }
    return 1;
}

static int on_readable(conn *c) {
    for (;;) {
        if (c->inlen == IN_CAP) return 0; /* a request larger than the buffer */
        ssize_t n = read(c->fd, c->in + c->inlen, IN_CAP - c->inlen);
        if (n == 0) return 0;
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return 0;
        }
        c->inlen += (size_t)n;
        if (!handle_requests(c)) return 0;
    }
    return flush(c);
}

/* Every event due up to now, tick by tick. */
static void advance(int64_t now_tick) {
    for (int64_t t = last_tick + 1; t <= now_tick; t++) {
        conn *c = wheel[t % WHEEL];
        while (c) {
            conn *next = c->wnext;
            if (c->due <= t) {
                wheel_remove(c);
                emit(c);
                if (c->sent < c->events) {
                    c->due = due_tick(c);
                    if (c->due <= t) c->due = t + 1;
                    wheel_add(c);
                } else {
                    c->streaming = 0;
                    active_streams--;
                }
                int ok = flush(c);
                /* a request pipelined behind the stream is answered now */
                if (ok && !c->streaming && c->inlen) ok = handle_requests(c) && flush(c);
                if (!ok) close_conn(c);
            }
            c = next;
        }
        if (now_tick - t > WHEEL) t = now_tick - WHEEL; /* a stall longer than the wheel: catch up once */
    }
    last_tick = now_tick;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s HOST PORT EVENTS RATE\n", argv[0]);
        return 2;
    }
    host_name = argv[1];
    int port = atoi(argv[2]);
    events_per_stream = atoi(argv[3]);
    rate = atof(argv[4]);
    if (port <= 0 || events_per_stream <= 0 || rate <= 0) {
        fprintf(stderr, "PORT, EVENTS and RATE must be positive\n");
        return 2;
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    signal(SIGPIPE, SIG_IGN);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (lfd < 0) die("socket");
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host_name, &addr.sin_addr) != 1) {
        fprintf(stderr, "HOST must be an IPv4 address\n");
        return 2;
    }
    if (bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0) die("bind");
    if (listen(lfd, 4096) < 0) die("listen");
    epfd = epoll_create1(0);
    if (epfd < 0) die("epoll_create1");
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, lfd, &lev) < 0) die("epoll_ctl");
    printf("listening %s:%d\n", host_name, port);
    fflush(stdout);

    last_tick = now_ns() / TICK_NS;
    struct epoll_event evs[MAX_EVENTS];
    while (!stopping) {
        int timeout = -1;
        if (active_streams) { /* sleep until the next slot that holds a stream, not tick by tick */
            int64_t slot = last_tick + 1;
            while (slot < last_tick + SCAN_SLOTS && !wheel[slot % WHEEL]) slot++;
            int64_t now = now_ns();
            int64_t next = slot * TICK_NS;
            timeout = next > now ? (int)((next - now + 999999) / 1000000) : 0;
        }
        int n = epoll_wait(epfd, evs, MAX_EVENTS, timeout);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            conn *c = evs[i].data.ptr;
            if (!c) {
                for (;;) {
                    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
                    if (fd < 0) break;
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn *nc = calloc(1, sizeof *nc);
                    if (!nc) die("calloc");
                    nc->fd = fd;
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = nc};
                    if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) < 0) die("epoll_ctl");
                }
                continue;
            }
            int alive = 1;
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) alive = on_readable(c);
            if (alive && (evs[i].events & EPOLLOUT)) alive = flush(c);
            if (!alive) close_conn(c);
        }
        advance(now_ns() / TICK_NS);
    }
    printf("{\"streams\": %lld, \"events\": %lld, \"unary\": %lld}\n", n_streams, n_events, n_unary);
    fflush(stdout);
    return 0;
}
