package main

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
)

//go:embed ui
var uiFiles embed.FS

// consoleConfig is what `rabbitmw ui` serves, and how.
type consoleConfig struct {
	amqpURLs []string // the nodes; the queue statistics use the first that answers
	queues   []string // the work queues
	top      broker.Topology
	store    *storeFlags // key lookups; nil or naming no store: none
	timeout  time.Duration
	readOnly bool
	token    string // required of every request, if set
	user     string // basic auth, if set
	password string
	logger   *slog.Logger
}

// A console is the web console: it shows the queues, the dead letters
// grouped by failure, each message, and keys in the store, and replays,
// purges and exports dead letters with the same operations as the
// command (package deadletter).
type console struct {
	consoleConfig
	b     *broker.Broker
	dl    *deadletter.Inspector
	stats *queueStats
	csrf  string // the token every form carries
	pages map[string]*template.Template
	// turn holds, by work queue, the one operation of the console on its
	// dead-letter queue at a time: an operation reads the queue by
	// taking every message (see deadletter.List), and would see the
	// queue without the messages another one holds.
	turn map[string]chan struct{}
}

func newConsole(cfg consoleConfig, b *broker.Broker) (*console, error) {
	var r [32]byte
	_, _ = rand.Read(r[:])
	c := &console{consoleConfig: cfg, b: b, dl: deadletter.New(b), stats: newQueueStats(cfg.amqpURLs, cfg.timeout),
		csrf: hex.EncodeToString(r[:]), pages: map[string]*template.Template{}, turn: map[string]chan struct{}{}}
	for _, q := range cfg.queues {
		c.turn[q] = make(chan struct{}, 1)
	}
	if c.logger == nil {
		c.logger = slog.New(slog.DiscardHandler)
	}
	pages, err := fs.Glob(uiFiles, "ui/page_*.html")
	if err != nil {
		return nil, err
	}
	for _, p := range pages {
		t, err := template.New("layout.html").Funcs(templateFuncs).ParseFS(uiFiles, "ui/layout.html", p)
		if err != nil {
			return nil, err
		}
		c.pages[strings.TrimSuffix(strings.TrimPrefix(p, "ui/page_"), ".html")] = t
	}
	return c, nil
}

// close releases the console's own connection.
func (c *console) close() { c.stats.close() }

// handler returns the console's handler: its pages, behind the checks of
// every request (the Host header, the token or basic auth), and its
// actions behind the cross-site checks as well.
func (c *console) handler(listen string) http.Handler {
	mux := http.NewServeMux()
	static, _ := fs.Sub(uiFiles, "ui/static")
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /{$}", c.queuesPage)
	mux.HandleFunc("GET /dlq", c.onQueue(c.dlqPage))
	mux.HandleFunc("GET /message", c.onQueue(c.messagePage))
	mux.HandleFunc("GET /export", c.onQueue(c.export))
	mux.HandleFunc("GET /key", c.keyPage)
	mux.HandleFunc("POST /confirm", c.onQueue(c.confirmPage))
	mux.HandleFunc("POST /do", c.onQueue(c.do))
	cop := http.NewCrossOriginProtection()
	cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.refuse(w, r, http.StatusForbidden, "refused: a request from another site (cross-origin)")
	}))
	return c.checkHost(listen, c.authenticate(cop.Handler(c.checkFetch(c.checkForm(mux)))))
}

// checkFetch refuses a request that the browser says another site's page
// made without the operator (after the cross-origin protection of the
// actions): cross-site, or same-site (another origin of the same site),
// and not a navigation the user made (a link followed, an address typed).
// An image, a script, a frame or a script's navigation of a page that
// the operator happened to open would otherwise have the console read a
// dead-letter queue, whose every read takes each message and puts it
// back: redelivered, and counted as a delivery by a quorum queue, which
// drops it past its delivery limit. Cross-origin protection covers the
// actions (POST) only. A client that sends no Sec-Fetch-Site header (not
// a browser, or an old one) is not refused.
func (c *console) checkFetch(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Header.Get("Sec-Fetch-Site") {
		case "", "same-origin", "none":
		default:
			if r.Header.Get("Sec-Fetch-Mode") != "navigate" || r.Header.Get("Sec-Fetch-User") != "?1" {
				c.refuse(w, r, http.StatusForbidden, "refused: a request that another site's page made (open the console's address yourself)")
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// checkHost refuses a request whose Host header is not the console's
// address when it listens on a loopback address: a page of another site
// that had its name resolve to 127.0.0.1 (DNS rebinding) is refused.
func (c *console) checkHost(listen string, next http.Handler) http.Handler {
	host, port, _ := net.SplitHostPort(listen)
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return next
	}
	ok := map[string]bool{net.JoinHostPort(host, port): true, net.JoinHostPort("localhost", port): true}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !ok[r.Host] {
			c.refuse(w, r, http.StatusForbidden, "refused: this console answers to "+listen+" only")
			return
		}
		next.ServeHTTP(w, r)
	})
}

const tokenCookie = "rabbitmw_token"

// authenticate requires the token (a bearer token, the cookie, or ?token=
// which sets the cookie) or the basic auth, when one is set.
func (c *console) authenticate(next http.Handler) http.Handler {
	if c.token == "" && c.user == "" {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if c.user != "" {
			u, p, ok := r.BasicAuth()
			if !ok || !equal(u, c.user) || !equal(p, c.password) {
				w.Header().Set("WWW-Authenticate", `Basic realm="rabbitmw", charset="UTF-8"`)
				c.refuse(w, r, http.StatusUnauthorized, "refused: log in")
				return
			}
			next.ServeHTTP(w, r)
			return
		}
		if t := r.URL.Query().Get("token"); t != "" && r.Method == http.MethodGet && equal(t, c.token) {
			http.SetCookie(w, &http.Cookie{Name: tokenCookie, Value: t, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode})
			q := r.URL.Query()
			q.Del("token")
			u := *r.URL
			u.RawQuery = q.Encode()
			http.Redirect(w, r, u.RequestURI(), http.StatusSeeOther)
			return
		}
		given := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
		if ck, err := r.Cookie(tokenCookie); err == nil && given == "" {
			given = ck.Value
		}
		if given == "" || !equal(given, c.token) {
			c.refuse(w, r, http.StatusUnauthorized, "refused: this console requires its token (open the address it printed at start)")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func equal(a, b string) bool { return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1 }

// maxForm is the largest form an action may post: a confirmation carries
// the key of every message it counted, 40 bytes a UUID, where net/http
// reads 10 MB by default.
const maxForm = 64 << 20

// checkForm requires the console's form token of every action, besides
// the cross-origin check, and refuses every action when read-only.
func (c *console) checkForm(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet || r.Method == http.MethodHead {
			next.ServeHTTP(w, r)
			return
		}
		if c.readOnly {
			c.refuse(w, r, http.StatusForbidden, "refused: the console is read-only")
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxForm)
		if err := r.ParseForm(); err != nil {
			var tooLarge *http.MaxBytesError
			if errors.As(err, &tooLarge) {
				c.refuse(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf("refused: the form is larger than %d MB: act on fewer messages at once, or use rabbitmw dlq with filters", maxForm>>20))
				return
			}
			c.refuse(w, r, http.StatusBadRequest, "refused: the form cannot be read: "+err.Error())
			return
		}
		if !equal(r.PostForm.Get("csrf"), c.csrf) {
			c.refuse(w, r, http.StatusForbidden, "refused: the form's token is missing or wrong (reload the page)")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (c *console) refuse(w http.ResponseWriter, r *http.Request, code int, why string) {
	c.logger.LogAttrs(r.Context(), slog.LevelWarn, "ui: refused", slog.String("method", r.Method),
		slog.String("path", r.URL.Path), slog.String("remote", r.RemoteAddr), slog.String("why", why))
	http.Error(w, why, code)
}

// render writes page with data.
func (c *console) render(w http.ResponseWriter, r *http.Request, page string, data map[string]any) {
	data["CSRF"] = c.csrf
	data["ReadOnly"] = c.readOnly
	data["Queues"] = c.queues
	data["HasStore"] = c.hasStore()
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store") // dead letters' bodies, and the form token
	w.Header().Set("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'")
	w.Header().Set("X-Frame-Options", "DENY")
	w.Header().Set("Referrer-Policy", "no-referrer")
	if err := c.pages[page].Execute(w, data); err != nil {
		c.logger.LogAttrs(r.Context(), slog.LevelError, "ui: render", slog.String("page", page), slog.Any("error", err))
	}
}

// fail shows err on a page of its own, with the command's exit code
// turned into an HTTP status.
func (c *console) fail(w http.ResponseWriter, r *http.Request, err error) {
	code := http.StatusInternalServerError
	var ee *exitError
	if errors.As(classify(err), &ee) {
		switch ee.code {
		case exitNotFound:
			code = http.StatusNotFound
		case exitRefused, exitUsage:
			code = http.StatusBadRequest
		}
	}
	w.WriteHeader(code)
	c.render(w, r, "error", map[string]any{"Title": "error", "Error": err.Error()})
}

// onQueue returns the handler of a page about one of the console's work
// queues, the q parameter: it refuses another queue, gives the page a
// context that bounds the operation, and runs it when no other page of
// the queue runs (see console.turn).
func (c *console) onQueue(page func(ctx context.Context, w http.ResponseWriter, r *http.Request, q string)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		q := r.FormValue("q")
		if !slices.Contains(c.queues, q) {
			c.fail(w, r, &exitError{exitNotFound, fmt.Errorf("%q is not a queue of this console", q)})
			return
		}
		ctx, cancel := c.ctx(r)
		defer cancel()
		select {
		case c.turn[q] <- struct{}{}:
		case <-ctx.Done():
			c.fail(w, r, fmt.Errorf("waiting for another operation on %s.dlq: %w", q, ctx.Err()))
			return
		}
		defer func() { <-c.turn[q] }()
		page(ctx, w, r, q)
	}
}

func (c *console) ctx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), 10*time.Minute)
}
