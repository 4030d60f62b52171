/* The load generator of perf/gateway.py's native mode: CONNS keep-alive HTTP/1.1 connections, one thread,
 * epoll, each sending the same POST (a chat completion, `Authorization: Bearer KEY` when given) back to
 * back (a closed loop). Connection i sends its first request at BEGIN + i/CONNS x RAMP s (paced starts);
 * requests go on until STOP; answers still in flight then are read to their end (for at most TIMEOUT s).
 *
 * Each answer is read as HTTP/1.1 (Content-Length, chunked, or to the connection's close) and its body as
 * server-sent events (the WHATWG HTML standard's event-stream format: an event is dispatched at a blank line
 * when a `data:` line came before it), so it counts `data:` events whatever the HTTP chunking; the time to
 * the first chunk is the time from the request's last byte sent to the answer's first body byte.
 *
 *   sse_loadgen HOST PORT PATH KEY BODY_FILE CONNS BEGIN START STOP RAMP MAX_REQUESTS TIMEOUT
 *
 * BEGIN, START and STOP are CLOCK_MONOTONIC seconds (Python's time.monotonic()); the window is
 * [START, STOP]. KEY "" sends no Authorization; MAX_REQUESTS > 0 stops each connection after that many
 * requests. Prints one JSON line: "latencies" and "ttfts" (s) of the 200 answers that ended in the
 * window, "events" (their events), "window_events" (events received in the window, whatever answer),
 * "completed", "errors" by kind ("connect", "io", "parse", "timeout", "status N" for an answer other than
 * 200), "cpu_s" (this process's CPU time in the window), "requests" and "all_events" (every 200 answer and
 * its events, in the window or not), "error_body" (the start of the first answer other than 200). Built by perf/native.py. */
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

#define BUF_CAP 32768
#define MAX_EVENTS 512

enum state { IDLE, CONNECTING, SENDING, HEAD, BODY_LENGTH, BODY_CLOSE, CHUNK_SIZE, CHUNK_DATA, CHUNK_END, TRAILER, DONE };
enum error { E_CONNECT, E_IO, E_STATUS, E_PARSE, E_TIMEOUT, E_COUNT };
static const char *error_names[E_COUNT] = {"connect", "io", "status", "parse", "timeout"};

typedef struct conn {
    int fd;
    int index;
    enum state st;
    int want_request; /* send as soon as connected */
    size_t woff;
    char buf[BUF_CAP];
    size_t len;
    int status, keep_alive;
    long long left; /* body bytes (Content-Length) or chunk bytes left */
    double sent, first;
    long events;
    int requests;
    /* the SSE line being read */
    int line_len, line_data, has_data;
} conn;

typedef struct {
    double *v;
    size_t n, cap;
} vec;

static const char *host;
static int port;
static char *request;
static size_t request_len;
static int nconns, max_requests;
static double begin, start, stop, ramp, timeout_s;
static conn *conns;
static int epfd;
static vec latencies, ttfts;
static long long events_done, window_events, completed, requests_done, all_events;
static long long errors[E_COUNT];
static long long statuses[600]; /* answers other than 200, by status */
static char error_body[300];     /* the start of the first answer other than 200 */
static size_t error_body_len;
static int error_body_done;
static double cpu_start = -1, cpu_stop = -1;
static int active;
static double now;

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double cpu(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

static void push(vec *v, double x) {
    if (v->n == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 1024;
        v->v = realloc(v->v, v->cap * sizeof *v->v);
        if (!v->v) die("realloc");
    }
    v->v[v->n++] = x;
}

static double first_start(int i) { return begin + (double)i / nconns * ramp; }

static void watch(conn *c, uint32_t events, int op) {
    struct epoll_event ev = {.events = events, .data.ptr = c};
    if (epoll_ctl(epfd, op, c->fd, &ev) < 0) die("epoll_ctl");
}

static void open_conn(conn *c) {
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (c->fd < 0) die("socket");
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &addr.sin_addr);
    c->len = 0;
    c->st = CONNECTING;
    if (connect(c->fd, (struct sockaddr *)&addr, sizeof addr) < 0 && errno != EINPROGRESS) {
        errors[E_CONNECT]++;
    }
    watch(c, EPOLLOUT, EPOLL_CTL_ADD);
}

static void close_conn(conn *c) {
    close(c->fd);
    c->fd = -1;
}

/* The connection is done with (its last request, or the window closed). */
static void retire(conn *c) {
    if (c->fd >= 0) close_conn(c);
    c->st = DONE;
    active--;
}

static int may_send(conn *c) { return now < stop && (max_requests <= 0 || c->requests < max_requests); }

static void send_request(conn *c) {
    c->st = SENDING;
    c->woff = 0;
    c->status = 0;
    c->events = 0;
    c->first = 0;
    c->line_len = c->line_data = c->has_data = 0;
    c->requests++;
    for (;;) {
        ssize_t n = write(c->fd, request + c->woff, request_len - c->woff);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                watch(c, EPOLLOUT, EPOLL_CTL_MOD);
                return;
            }
            errors[E_IO]++;
            close_conn(c);
            if (may_send(c)) open_conn(c), c->want_request = 1;
            else retire(c);
            return;
        }
        c->woff += (size_t)n;
        if (c->woff == request_len) break;
    }
    c->sent = now = mono(); /* the answer may be read before the loop reads the clock again */
    c->st = HEAD;
    watch(c, EPOLLIN, EPOLL_CTL_MOD);
}

/* The next request on this connection, or its end. */
static void next(conn *c) {
    if (!may_send(c)) {
        retire(c);
    } else if (!c->keep_alive) {
        close_conn(c);
        open_conn(c);
        c->want_request = 1;
    } else {
        send_request(c);
    }
}

static void fail(conn *c, enum error kind) {
    errors[kind]++;
    close_conn(c);
    if (may_send(c)) {
        open_conn(c);
        c->want_request = 1;
    } else {
        retire(c);
    }
}

/* Body bytes, read as an event stream. */
static void feed(conn *c, const char *p, size_t n) {
    static const char prefix[] = "data:";
    if (!c->first) c->first = now;
    if (c->status != 200 && !error_body_done)
        for (size_t i = 0; i < n && error_body_len < sizeof error_body - 1; i++) error_body[error_body_len++] = p[i];
    for (size_t i = 0; i < n; i++) {
        char ch = p[i];
        if (ch == '\n') {
            if (c->line_len == 0) {
                if (c->has_data) {
                    c->events++;
                    all_events++;
                    if (now >= start && now <= stop) window_events++;
                    c->has_data = 0;
                }
            } else if (c->line_data && c->line_len >= 5) {
                c->has_data = 1;
            }
            c->line_len = 0;
            c->line_data = 0;
        } else if (ch != '\r') {
            if (c->line_len == 0) c->line_data = 1;
            if (c->line_len < 5 && ch != prefix[c->line_len]) c->line_data = 0;
            c->line_len++;
        }
    }
}

static void answer_done(conn *c) {
    requests_done++;
    if (c->status == 200) {
        if (now >= start && now <= stop) {
            push(&latencies, now - c->sent);
            push(&ttfts, (c->first ? c->first : now) - c->sent);
            events_done += c->events;
            completed++;
        }
    } else {
        errors[E_STATUS]++;
        statuses[c->status > 0 && c->status < 600 ? c->status : 0]++;
        error_body_done = 1;
    }
    next(c);
}

/* Parses what is buffered; returns 0 when the connection was handed on (next request, closed). */
static int parse(conn *c) {
    size_t off = 0;
    int go = 1;
    while (go) {
        char *data = c->buf + off;
        size_t avail = c->len - off;
        switch (c->st) {
        case HEAD: {
            char *end = memmem(data, avail, "\r\n\r\n", 4);
            if (!end) {
                if (c->len == BUF_CAP && off == 0) {
                    fail(c, E_PARSE);
                    return 0;
                }
                go = 0;
                break;
            }
            *end = 0;
            if (strncmp(data, "HTTP/1.", 7) != 0) {
                fail(c, E_PARSE);
                return 0;
            }
            c->status = atoi(data + 9);
            c->keep_alive = data[7] == '1';
            long long length = -1;
            int chunked = 0;
            for (char *line = strchr(data, '\n'); line; line = strchr(line, '\n')) {
                line++;
                if (strncasecmp(line, "content-length:", 15) == 0) length = atoll(line + 15);
                else if (strncasecmp(line, "transfer-encoding:", 18) == 0) chunked = strcasestr(line, "chunked") != NULL;
                else if (strncasecmp(line, "connection:", 11) == 0) {
                    char *eol = strchr(line, '\r');
                    char *close_word = strcasestr(line, "close");
                    if (close_word && (!eol || close_word < eol)) c->keep_alive = 0;
                }
            }
            off += (size_t)(end - data) + 4;
            if (chunked) c->st = CHUNK_SIZE;
            else if (length >= 0) c->st = BODY_LENGTH, c->left = length;
            else c->st = BODY_CLOSE, c->keep_alive = 0;
            if (c->st == BODY_LENGTH && c->left == 0) {
                c->len -= off;
                memmove(c->buf, c->buf + off, c->len);
                answer_done(c);
                return 0;
            }
            break;
        }
        case BODY_LENGTH: {
            size_t take = avail < (size_t)c->left ? avail : (size_t)c->left;
            if (take) feed(c, data, take);
            off += take;
            c->left -= (long long)take;
            if (c->left == 0) {
                c->len -= off;
                memmove(c->buf, c->buf + off, c->len);
                answer_done(c);
                return 0;
            }
            go = 0;
            break;
        }
        case BODY_CLOSE:
            if (avail) feed(c, data, avail);
            off += avail;
            go = 0;
            break;
        case CHUNK_SIZE: {
            char *eol = memmem(data, avail, "\r\n", 2);
            if (!eol) {
                go = 0;
                break;
            }
            char *hex_end;
            c->left = strtoll(data, &hex_end, 16);
            if (hex_end == data || c->left < 0) {
                fail(c, E_PARSE);
                return 0;
            }
            off += (size_t)(eol - data) + 2;
            c->st = c->left ? CHUNK_DATA : TRAILER;
            break;
        }
        case CHUNK_DATA: {
            size_t take = avail < (size_t)c->left ? avail : (size_t)c->left;
            if (take) feed(c, data, take);
            off += take;
            c->left -= (long long)take;
            if (c->left) {
                go = 0;
                break;
            }
            c->st = CHUNK_END;
            break;
        }
        case CHUNK_END:
            if (avail < 2) {
                go = 0;
                break;
            }
            off += 2;
            c->st = CHUNK_SIZE;
            break;
        case TRAILER: {
            char *eol = memmem(data, avail, "\r\n", 2);
            if (!eol) {
                go = 0;
                break;
            }
            off += (size_t)(eol - data) + 2;
            if (eol == data) {
                c->len -= off;
                memmove(c->buf, c->buf + off, c->len);
                answer_done(c);
                return 0;
            }
            break;
        }
        default:
            go = 0;
        }
    }
    c->len -= off;
    memmove(c->buf, c->buf + off, c->len);
    return 1;
}

static void on_readable(conn *c) {
    for (;;) {
        if (c->len == BUF_CAP) {
            fail(c, E_PARSE);
            return;
        }
        ssize_t n = read(c->fd, c->buf + c->len, BUF_CAP - c->len);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            fail(c, E_IO);
            return;
        }
        if (n == 0) {
            if (c->st == BODY_CLOSE) { /* the answer's end */
                c->keep_alive = 0;
                answer_done(c);
            } else {
                fail(c, E_IO);
            }
            return;
        }
        c->len += (size_t)n;
        now = mono();
        /* an answer may end, and the next request go out, in the middle of what was read */
        while (!parse(c) && c->st == HEAD && c->len) {
        }
        if (c->st < HEAD || c->st > TRAILER) return;
    }
}

static void on_writable(conn *c) {
    if (c->st == CONNECTING) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            fail(c, E_CONNECT);
            return;
        }
        c->st = IDLE;
        watch(c, 0, EPOLL_CTL_MOD);
        if (c->want_request) {
            c->want_request = 0;
            if (may_send(c)) send_request(c);
            else retire(c);
        }
        return;
    }
    if (c->st == SENDING) {
        while (c->woff < request_len) {
            ssize_t n = write(c->fd, request + c->woff, request_len - c->woff);
            if (n < 0) {
                if (errno == EAGAIN) return;
                fail(c, E_IO);
                return;
            }
            c->woff += (size_t)n;
        }
        c->sent = now = mono();
        c->st = HEAD;
        watch(c, EPOLLIN, EPOLL_CTL_MOD);
    }
}

static void print_vec(const char *name, vec *v) {
    printf("\"%s\": [", name);
    for (size_t i = 0; i < v->n; i++) printf(i ? ",%.6f" : "%.6f", v->v[i]);
    printf("]");
}

int main(int argc, char **argv) {
    if (argc != 13) {
        fprintf(stderr, "usage: %s HOST PORT PATH KEY BODY_FILE CONNS BEGIN START STOP RAMP MAX_REQUESTS TIMEOUT\n",
                argv[0]);
        return 2;
    }
    host = argv[1];
    port = atoi(argv[2]);
    const char *path = argv[3], *key = argv[4];
    FILE *f = fopen(argv[5], "rb");
    if (!f) die(argv[5]);
    static char body[1 << 16];
    size_t body_len = fread(body, 1, sizeof body, f);
    fclose(f);
    nconns = atoi(argv[6]);
    begin = atof(argv[7]);
    start = atof(argv[8]);
    stop = atof(argv[9]);
    ramp = atof(argv[10]);
    max_requests = atoi(argv[11]);
    timeout_s = atof(argv[12]);
    if (nconns <= 0 || port <= 0) {
        fprintf(stderr, "CONNS and PORT must be positive\n");
        return 2;
    }
    struct in_addr probe;
    if (inet_pton(AF_INET, host, &probe) != 1) {
        fprintf(stderr, "HOST must be an IPv4 address\n");
        return 2;
    }
    request = malloc(body_len + 1024 + strlen(key) + strlen(path));
    if (!request) die("malloc");
    int n = sprintf(request, "POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n", path, host, port);
    if (*key) n += sprintf(request + n, "Authorization: Bearer %s\r\n", key);
    n += sprintf(request + n, "Content-Length: %zu\r\n\r\n", body_len);
    memcpy(request + n, body, body_len);
    request_len = (size_t)n + body_len;

    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    signal(SIGPIPE, SIG_IGN);
    epfd = epoll_create1(0);
    if (epfd < 0) die("epoll_create1");
    conns = calloc((size_t)nconns, sizeof *conns);
    if (!conns) die("calloc");
    now = mono();
    for (int i = 0; i < nconns; i++) { /* connect now (warm-up); the first requests follow the ramp */
        conns[i].index = i;
        open_conn(&conns[i]);
    }
    active = nconns;
    int next_start = 0; /* the first connection whose first request is not sent yet */
    double deadline = stop + timeout_s;
    struct epoll_event evs[MAX_EVENTS];
    while (active > 0) {
        now = mono();
        if (cpu_start < 0 && now >= start) cpu_start = cpu();
        if (cpu_stop < 0 && now >= stop) cpu_stop = cpu();
        while (next_start < nconns && now >= first_start(next_start)) {
            conn *c = &conns[next_start++];
            if (c->st == IDLE) {
                if (may_send(c)) send_request(c);
                else retire(c);
            } else if (c->st == CONNECTING) {
                c->want_request = 1;
            }
        }
        if (now >= deadline) break;
        double wake = deadline;
        if (next_start < nconns && first_start(next_start) < wake) wake = first_start(next_start);
        if (cpu_start < 0 && start < wake) wake = start;
        if (cpu_stop < 0 && stop < wake) wake = stop;
        int timeout = (int)((wake - now) * 1000.0 + 0.999);
        if (timeout < 0) timeout = 0;
        int ready = epoll_wait(epfd, evs, MAX_EVENTS, timeout);
        if (ready < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        now = mono();
        for (int i = 0; i < ready; i++) {
            conn *c = evs[i].data.ptr;
            if (c->st == DONE || c->fd < 0) continue;
            if (evs[i].events & EPOLLOUT) on_writable(c);
            if (c->st == DONE || c->fd < 0) continue;
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                if (c->st >= HEAD && c->st <= TRAILER) on_readable(c);
                else if (c->st == IDLE) fail(c, E_IO); /* closed while idle */
            }
        }
    }
    if (cpu_start < 0) cpu_start = cpu();
    if (cpu_stop < 0) cpu_stop = cpu();
    for (int i = 0; i < nconns; i++)
        if (conns[i].st != DONE) errors[E_TIMEOUT] += conns[i].st >= SENDING && conns[i].st <= TRAILER;
    printf("{");
    print_vec("latencies", &latencies);
    printf(", ");
    print_vec("ttfts", &ttfts);
    printf(", \"events\": %lld, \"window_events\": %lld, \"completed\": %lld, \"requests\": %lld, "
           "\"all_events\": %lld, \"cpu_s\": %.6f, \"errors\": {",
           events_done, window_events, completed, requests_done, all_events, cpu_stop - cpu_start);
    int first = 1;
    for (int k = 0; k < E_COUNT; k++) {
        if (!errors[k] || k == E_STATUS) continue; /* those by status, below */
        printf("%s\"%s\": %lld", first ? "" : ", ", error_names[k], errors[k]);
        first = 0;
    }
    for (int k = 0; k < 600; k++) {
        if (!statuses[k]) continue;
        printf("%s\"status %d\": %lld", first ? "" : ", ", k, statuses[k]);
        first = 0;
    }
    printf("}, \"error_body\": \"");
    for (size_t i = 0; i < error_body_len; i++) {
        unsigned char ch = (unsigned char)error_body[i];
        if (ch == '"' || ch == '\\') printf("\\%c", ch);
        else putchar(ch < 0x20 || ch > 0x7e ? '?' : ch);
    }
    printf("\"}\n");
    return 0;
}
