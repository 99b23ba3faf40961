package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// serveConsole serves a console of cfg on a loopback port of its own
// until t ends, and returns its base URL.
func serveConsole(t *testing.T, b *broker.Broker, cfg consoleConfig) string {
	t.Helper()
	if cfg.timeout == 0 {
		cfg.timeout = 10 * time.Second
	}
	con, err := newConsole(cfg, b)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: con.handler(ln.Addr().String())}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		<-served
		con.close()
	})
	return "http://" + ln.Addr().String()
}

// newBrowser returns the context of a headless Chromium, closed when t
// ends. It skips t (fails it under CI) without Chromium.
func newBrowser(t *testing.T) context.Context {
	t.Helper()
	path := ""
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			path = p
			break
		}
	}
	if path == "" {
		testenv.Missing(t, "Chromium", "install it with: apt-get install -y chromium")
	}
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(path),
		chromedp.Flag("headless", true),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 900),
	)
	ctx, cancelBrowser := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancelBrowser()
		cancelAlloc()
	})
	require.NoError(t, chromedp.Do(ctx, chromedp.Navigate("about:blank")), "start Chromium")
	return ctx
}

// waitPath waits until the browser shows a page at path, loaded.
func waitPath(t *testing.T, browser context.Context, path string) {
	t.Helper()
	require.Eventually(t, func() bool {
		// An evaluation that a navigation interrupts fails: not there yet.
		ok, err := chromedp.Run(browser, chromedp.Evaluate[bool](`location.pathname === "`+path+`" && document.readyState === "complete"`))
		return err == nil && ok
	}, 30*time.Second, 20*time.Millisecond, "the browser never showed %s", path)
}

// text returns the text of the first element sel selects.
func text(t *testing.T, browser context.Context, sel string) string {
	t.Helper()
	v, err := chromedp.Run(browser, chromedp.Text(sel))
	require.NoError(t, err, "text of %s", sel)
	return v
}

// declinedError is the failure of the test's consumer: a card declined,
// its number and the order in the text.
type declinedError struct{ card, order int }

func (e *declinedError) Error() string {
	return fmt.Sprintf("card %d declined for order %d", e.card, e.order)
}

// A consumer dead-letters three messages that fail the same way; the
// console shows them as one group of three; replaying the group from the
// page empties the dead-letter queue, and the consumer, fixed meanwhile,
// handles each message once. A form posted from another origin, or
// without the console's form token, is refused and moves nothing.
func TestConsoleInBrowser(t *testing.T) {
	b, url, q := setupQueue(t)
	browser := newBrowser(t)
	base := serveConsole(t, b, consoleConfig{amqpURLs: []string{url}, queues: []string{q}})

	var failing atomic.Bool
	failing.Store(true)
	var mu sync.Mutex
	handled := map[string]int{}
	h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if failing.Load() {
			var n int
			fmt.Sscan(strings.TrimPrefix(d.MessageId, "order-"), &n)
			return rabbitmw.Permanent(&declinedError{4000 + n, n})
		}
		mu.Lock()
		handled[d.MessageId]++
		mu.Unlock()
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	consumeCtx, stop := context.WithCancel(ctx)
	consumed := make(chan error, 1)
	go func() { consumed <- b.Consume(consumeCtx, q, h, broker.ConsumeOptions{Workers: 2}) }()
	defer func() {
		stop()
		require.NoError(t, <-consumed)
	}()
	publish := func(ids ...string) {
		for _, id := range ids {
			require.NoError(t, b.Publish(ctx, "", q, amqp.Publishing{MessageId: id, ContentType: "application/json",
				Body: []byte(`{"order":"` + id + `","amount":42}`)}))
		}
	}
	dlqHolds := func(n int) {
		t.Helper()
		require.Eventually(t, func() bool {
			got, err := b.Len(ctx, q+".dlq")
			return err == nil && got == n
		}, time.Minute, 50*time.Millisecond, "the dead-letter queue never held %d", n)
	}
	publish("order-1", "order-2", "order-3")
	dlqHolds(3)

	// The group, with its count.
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(base+"/dlq?q="+q), chromedp.WaitVisible(".group")))
	assert.Equal(t, "3", text(t, browser, ".group .count"))
	assert.Equal(t, "card # declined for order #", text(t, browser, ".group .pattern"))
	assert.Equal(t, "*main.declinedError", text(t, browser, ".group .type"))
	if path := os.Getenv("RABBITMW_SCREENSHOT"); path != "" {
		png, err := chromedp.Run(browser, chromedp.FullScreenshot(100))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(path, png, 0o644))
	}

	// An action from the console's own page without its form token.
	_, err := chromedp.Run(browser, chromedp.Evaluate[any](`document.querySelectorAll('input[name=csrf]').forEach(e => e.remove())`))
	require.NoError(t, err)
	require.NoError(t, chromedp.Do(browser, chromedp.Click(".group .replay-group", chromedp.NodeVisible)))
	waitPath(t, browser, "/confirm")
	assert.Contains(t, text(t, browser, "body"), "form's token is missing or wrong")

	// An action from another origin, even with the form token.
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(base+"/dlq?q="+q), chromedp.WaitVisible(".group")))
	csrf, err := chromedp.Run(browser, chromedp.Value(`.group input[name=csrf]`))
	require.NoError(t, err)
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, `<!doctype html><form id="f" method="post" action="%s/do">
<input name="csrf" value="%s"><input name="q" value="%s"><input name="action" value="purge">
<input name="id" value="order-1"><input name="id" value="order-2"><input name="id" value="order-3"></form>
<script>document.getElementById("f").submit()</script>`, base, csrf, q)
	}))
	defer evil.Close()
	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(evil.URL)))
	waitPath(t, browser, "/do")
	assert.Contains(t, text(t, browser, "body"), "refused: a request from another site")
	dlqHolds(3)
	n, err := b.Len(ctx, q)
	require.NoError(t, err)
	require.Zero(t, n, "the work queue")

	// Replay the group, after the confirmation that counts it.
	failing.Store(false)
	require.NoError(t, chromedp.Do(browser,
		chromedp.Navigate(base+"/dlq?q="+q),
		chromedp.Click(".group .replay-group", chromedp.NodeVisible),
		chromedp.WaitVisible("#confirm"),
	))
	assert.Equal(t, "3", text(t, browser, ".confirm-text .count"))
	require.NoError(t, chromedp.Do(browser, chromedp.Click("#confirm"), chromedp.WaitVisible("#done")))
	assert.Equal(t, "replayed 3 message(s) to their queues", text(t, browser, "#done"))
	dlqHolds(0)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == 3
	}, time.Minute, 20*time.Millisecond)
	// Whatever RabbitMQ still had to deliver has had time to arrive.
	time.Sleep(500 * time.Millisecond)
	mu.Lock()
	assert.Equal(t, map[string]int{"order-1": 1, "order-2": 1, "order-3": 1}, handled)
	mu.Unlock()

	require.NoError(t, chromedp.Do(browser, chromedp.Navigate(base+"/dlq?q="+q)))
	assert.Equal(t, "No dead letters.", text(t, browser, ".empty"))
}

// The requests the console refuses, and those it serves: without the
// token, with the wrong Host, an action when read-only, an action without
// its form token.
func TestConsoleRefusals(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	tokened := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}, token: "s3cret"})
	readOnly := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}, readOnly: true})
	basic := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}, user: "ops", password: "pw"})
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}

	do := func(method, u string, form url.Values, set func(*http.Request)) (*http.Response, string) {
		t.Helper()
		var r *http.Request
		var err error
		if form != nil {
			r, err = http.NewRequest(method, u, strings.NewReader(form.Encode()))
			require.NoError(t, err)
			r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		} else {
			r, err = http.NewRequest(method, u, nil)
			require.NoError(t, err)
		}
		if set != nil {
			set(r)
		}
		resp, err := noRedirect.Do(r)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp, string(body)
	}
	resp, _ := do("GET", tokened+"/", nil, nil)
	assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "no token")
	resp, _ = do("GET", tokened+"/", nil, func(r *http.Request) { r.Header.Set("Authorization", "Bearer wrong") })
	assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "a wrong token")
	resp, _ = do("GET", tokened+"/", nil, func(r *http.Request) { r.Header.Set("Authorization", "Bearer s3cret") })
	assert.Equal(t, http.StatusOK, resp.StatusCode, "the token")
	resp, _ = do("GET", tokened+"/dlq?q="+q+"&token=s3cret", nil, nil)
	require.Equal(t, http.StatusSeeOther, resp.StatusCode, "?token= sets the cookie")
	assert.Equal(t, "/dlq?q="+q, resp.Header.Get("Location"))
	cookie := resp.Cookies()[0]
	assert.True(t, cookie.HttpOnly)
	resp, _ = do("GET", tokened+"/", nil, func(r *http.Request) { r.AddCookie(cookie) })
	assert.Equal(t, http.StatusOK, resp.StatusCode, "the cookie")

	resp, _ = do("GET", basic+"/", nil, nil)
	assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "no basic auth")
	resp, _ = do("GET", basic+"/", nil, func(r *http.Request) { r.SetBasicAuth("ops", "pw") })
	assert.Equal(t, http.StatusOK, resp.StatusCode, "basic auth")

	resp, _ = do("GET", readOnly+"/", nil, func(r *http.Request) { r.Host = "rebound.example.com" + r.Host[strings.LastIndex(r.Host, ":"):] })
	assert.Equal(t, http.StatusForbidden, resp.StatusCode, "another Host on loopback")

	resp, body := do("POST", readOnly+"/confirm", url.Values{"q": {q}, "action": {"purge"}, "id": {"x"}}, nil)
	assert.Equal(t, http.StatusForbidden, resp.StatusCode)
	assert.Contains(t, body, "read-only")
	_, page := do("GET", readOnly+"/dlq?q="+q, nil, nil)
	assert.NotContains(t, page, "<button", "a read-only page offers an action")

	writable := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}})
	resp, body = do("POST", writable+"/do", url.Values{"q": {q}, "action": {"purge"}, "id": {"x"}}, nil)
	assert.Equal(t, http.StatusForbidden, resp.StatusCode)
	assert.Contains(t, body, "form's token")
	resp, _ = do("GET", writable+"/dlq?q=another-queue", nil, nil)
	assert.Equal(t, http.StatusNotFound, resp.StatusCode, "a queue the console does not serve")
}

// The console's replay follows dlq replay's rule: a dead letter whose
// x-rabbitmw-original-queue header names another queue than the one whose
// dead-letter queue holds it is refused, naming both, and nothing moves.
func TestConsoleReplayRefusesAnotherQueue(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	other := foreignDeadLetters(t, b, q)
	base := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}})
	resp, err := http.Get(base + "/dlq?q=" + q)
	require.NoError(t, err)
	page, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindSubmatch(page)
	require.NotNil(t, m, "the form token in %s", page)
	resp, err = http.PostForm(base+"/do", url.Values{"csrf": {string(m[1])}, "q": {q}, "action": {"replay"},
		"id": {"own", "foreign", "own-2"}})
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode, "%s", body)
	text := html.UnescapeString(string(body))
	for _, want := range []string{`"foreign"`, `"` + other + `"`, `"` + q + `.dlq"`} {
		assert.Contains(t, text, want)
	}
	for queue, want := range map[string]int{q: 0, other: 0, q + ".dlq": 3} {
		n, err := b.Len(ctx, queue)
		require.NoError(t, err)
		assert.Equal(t, want, n, "messages in %s", queue)
	}
}

// `rabbitmw ui` refuses an address that is not loopback without a token
// or basic auth.
func TestConsoleListenNeedsAuth(t *testing.T) {
	_, stderr, code := cli(t, "", nil, "ui", "-q", "orders", "--listen", "0.0.0.0:0")
	expectCode(t, "ui --listen 0.0.0.0:0", code, exitUsage, stderr)
	assert.Contains(t, stderr, "--token or --basic-auth")
}

// A message's page shows its properties, its headers with their AMQP
// types, its body as JSON, text and hex, and its earlier lives; the
// export downloads it; the queues page counts it; a key is looked up in
// the store.
func TestConsolePages(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	prefix := "rabbitmw-test-ui:" + q + ":"
	base := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q},
		store: &storeFlags{redis: testenv.RedisAddr(t), prefix: prefix}})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	h := faulty(q, "*main.declinedError", "card 4242 declined", time.Now())
	h[deadletter.HeaderHistory] = []any{amqp.Table{"replayed-at": time.Now().UTC().Truncate(time.Second), broker.HeaderError: "an earlier failure"}}
	require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: "m-1", ContentType: "application/json",
		Body: []byte(`{"order":"m-1","amount":42}`), Headers: h}))

	get := func(path string) (int, string, http.Header) {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(body), resp.Header
	}
	code, page, _ := get("/message?q=" + q + "&id=m-1")
	require.Equal(t, http.StatusOK, code, page)
	for _, want := range []string{
		"application/json", // a property
		"x-rabbitmw-attempts</code></td><td class=\"type\">int64", // a header with its type
		"x-rabbitmw-failed-at</code></td><td class=\"type\">timestamp",
		"&#34;amount&#34;: 42",  // the body as indented JSON
		"00000000  7b 22 6f 72", // and in hex
		"life 1",                // the earlier life
		"an earlier failure",
	} {
		assert.Contains(t, page, want)
	}
	code, _, _ = get("/message?q=" + q + "&id=nope")
	assert.Equal(t, http.StatusNotFound, code)

	code, export, hdr := get("/export?q=" + q)
	require.Equal(t, http.StatusOK, code)
	assert.Contains(t, hdr.Get("Content-Disposition"), "attachment")
	assert.Equal(t, 1, strings.Count(export, "\n"))
	assert.Contains(t, export, `"message_id":"m-1"`)

	code, page, _ = get("/")
	require.Equal(t, http.StatusOK, code, page)
	assert.Contains(t, page, `data-queue="`+q+`.dlq">1<`)
	assert.Contains(t, page, `data-queue="`+q+`">0<`)

	rc := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t)})
	defer rc.Close()
	require.NoError(t, rc.Set(ctx, prefix+"retry:m-1", 2, time.Hour).Err())
	t.Cleanup(func() { rc.Del(context.Background(), prefix+"retry:m-1") })
	code, page, _ = get("/key?k=m-1")
	require.Equal(t, http.StatusOK, code, page)
	assert.Regexp(t, `<th>state</th><td>absent</td>`, page)
	assert.Regexp(t, `<th>failures</th><td>2</td>`, page)
}

// `rabbitmw ui` serves until interrupted, then stops and exits 0; the
// address it prints with ?token= logs the browser in; -h does not show
// the token of the environment.
func TestUICommand(t *testing.T) {
	_, amqpURL, q := setupQueue(t)
	cmd := exec.Command(binary, "ui", "-q", q, "--listen", "127.0.0.1:0")
	cmd.Env = append(os.Environ(), "RABBITMQ_URL="+amqpURL, "RABBITMW_UI_TOKEN=t0ken")
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})
	line, err := bufio.NewReader(stderr).ReadString('\n')
	require.NoError(t, err)
	_, addr, ok := strings.Cut(strings.TrimSpace(line), " on ")
	require.True(t, ok, "first line: %q", line)
	require.True(t, strings.HasSuffix(addr, "/?token=t0ken"), "address %q", addr)

	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	client := &http.Client{Jar: jar}
	resp, err := client.Get(addr)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, string(body), q+".dlq")

	help := exec.Command(binary, "ui", "-h")
	help.Env = cmd.Env
	out, err := help.Output()
	require.NoError(t, err)
	assert.NotContains(t, string(out), "t0ken")

	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	select {
	case err := <-exited:
		require.NoError(t, err, "exit after an interrupt")
	case <-time.After(30 * time.Second):
		t.Fatal("rabbitmw ui did not stop within 30s of an interrupt")
	}
}

// A consoleForm is a form of a console page: where it posts, and the
// values a browser would send with it.
type consoleForm struct {
	action string
	values url.Values
}

var (
	formRE   = regexp.MustCompile(`(?s)<form method="post" action="([^"]+)"[^>]*>(.*?)</form>`)
	hiddenRE = regexp.MustCompile(`<input type="hidden" name="([^"]+)" value="([^"]*)">`)
)

// forms returns the post forms of page, each with its hidden inputs.
func forms(page string) []consoleForm {
	var out []consoleForm
	for _, m := range formRE.FindAllStringSubmatch(page, -1) {
		f := consoleForm{action: m[1], values: url.Values{}}
		for _, h := range hiddenRE.FindAllStringSubmatch(m[2], -1) {
			f.values.Add(html.UnescapeString(h[1]), html.UnescapeString(h[2]))
		}
		out = append(out, f)
	}
	return out
}

// submit posts f, with the button action=action, and returns the status
// and the page.
func (f consoleForm) submit(t *testing.T, base, action string) (int, string) {
	t.Helper()
	v := url.Values{}
	for k, vs := range f.values {
		v[k] = append([]string(nil), vs...)
	}
	if action != "" {
		v.Set("action", action)
	}
	resp, err := http.PostForm(base+f.action, v)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// getPage returns the status and the page at path.
func getPage(t *testing.T, base, path string) (int, string) {
	t.Helper()
	resp, err := http.Get(base + path)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

// publishRaw publishes p to queue on a channel of its own: unlike
// Broker.Publish, it leaves a message without an id without one.
func publishRaw(t *testing.T, amqpURL, queue string, p amqp.Publishing) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, p)
	require.NoError(t, err)
	ok, err := dc.WaitContext(ctx)
	require.NoError(t, err)
	require.True(t, ok, "nacked")
}

// An action moves no more messages than its confirmation counted: a
// dead letter that arrives between the confirmation and the click, of
// the group confirmed or with an id confirmed, stays.
func TestConsoleActsOnWhatItConfirmed(t *testing.T) {
	for _, tc := range []struct {
		name    string
		first   []amqp.Publishing // in the dead-letter queue at the confirmation
		confirm func(t *testing.T, base, q, page string) (int, string)
		late    amqp.Publishing // arrives before the click
	}{{
		name:  "a group with a message without an id",
		first: []amqp.Publishing{{MessageId: "m-1", Body: []byte("one")}, {Body: []byte("no id")}},
		confirm: func(t *testing.T, base, q, page string) (int, string) {
			return forms(page)[0].submit(t, base, "purge") // the group's form
		},
		late: amqp.Publishing{MessageId: "m-3", Body: []byte("three")},
	}, {
		name:  "an id that repeats",
		first: []amqp.Publishing{{MessageId: "dup", Body: []byte("first")}},
		confirm: func(t *testing.T, base, q, page string) (int, string) {
			f := forms(page)[1] // the table's form
			f.values.Set("id", "dup")
			return f.submit(t, base, "purge")
		},
		late: amqp.Publishing{MessageId: "dup", Body: []byte("published again, failed again")},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			b, amqpURL, q := setupQueue(t)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			base := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}})
			for _, p := range tc.first {
				p.Headers = faulty(q, "*main.declinedError", "card declined", time.Now())
				publishRaw(t, amqpURL, q+".dlq", p)
			}
			code, page := getPage(t, base, "/dlq?q="+q)
			require.Equal(t, http.StatusOK, code, page)
			code, page = tc.confirm(t, base, q, page)
			require.Equal(t, http.StatusOK, code, page)
			want := len(tc.first)
			require.Contains(t, page, fmt.Sprintf("Purge %d message(s)?", want))

			tc.late.Headers = faulty(q, "*main.declinedError", "card declined", time.Now())
			publishRaw(t, amqpURL, q+".dlq", tc.late)

			confirmed := forms(page)
			require.Len(t, confirmed, 1, "the confirmation's form in %s", page)
			code, page = confirmed[0].submit(t, base, "")
			require.Equal(t, http.StatusOK, code, page)
			assert.Contains(t, page, fmt.Sprintf("removed %d message(s)", want))
			n, err := b.Len(ctx, q+".dlq")
			require.NoError(t, err)
			assert.Equal(t, 1, n, "the dead letter that came after the confirmation is still there")
		})
	}
}

// A message's own Replay or Purge acts on that message, whatever its id:
// one with a space or a line break in it, next to messages whose ids are
// its parts.
func TestConsoleActsOnTheMessageShown(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	base := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}})
	ids := []string{"order-1", " order-1", "order-2", "order-3", "order-2\norder-3"}
	for _, id := range ids {
		publishRaw(t, amqpURL, q+".dlq", amqp.Publishing{MessageId: id, Body: []byte("body"),
			Headers: faulty(q, "*main.declinedError", "card declined", time.Now())})
	}
	for _, id := range []string{" order-1", "order-2\norder-3"} {
		code, page := getPage(t, base, "/message?q="+q+"&id="+url.QueryEscape(id))
		require.Equal(t, http.StatusOK, code, page)
		fs := forms(page)
		require.NotEmpty(t, fs, "the message's form in %s", page)
		code, page = fs[0].submit(t, base, "purge")
		require.Equal(t, http.StatusOK, code, page)
		assert.Contains(t, page, "Purge 1 message(s)?", "the confirmation of %q", id)
		confirmed := forms(page)
		require.Len(t, confirmed, 1, "the confirmation's form in %s", page)
		code, page = confirmed[0].submit(t, base, "")
		require.Equal(t, http.StatusOK, code, page)
		assert.Contains(t, page, "removed 1 message(s)", "the purge of %q", id)
	}
	left := drain(t, b, q+".dlq")
	assert.ElementsMatch(t, []string{"order-1", "order-2", "order-3"}, left)
}

// Pages of the same dead-letter queue loaded at once (two operators, two
// tabs) each count every message: one does not see the queue without
// the messages another holds while it reads them.
func TestConsoleConcurrentPages(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	base := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}})
	const n = 300
	deadLetters(t, b, q, n)
	pages := make([]string, 4)
	var wg sync.WaitGroup
	for i := range pages {
		wg.Go(func() {
			resp, err := http.Get(base + "/dlq?q=" + q)
			if !assert.NoError(t, err) {
				return
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			assert.NoError(t, err)
			pages[i] = string(body)
		})
	}
	wg.Wait()
	for i, page := range pages {
		count := regexp.MustCompile(`<small>(\d+) message\(s\)</small>`).FindStringSubmatch(page)
		require.NotNil(t, count, "page %d: %s", i, page)
		assert.Equal(t, strconv.Itoa(n), count[1], "the count of page %d", i)
	}
}

// The pages and the download that show dead letters' bodies are not
// kept by the browser or a proxy.
func TestConsoleNotCached(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	base := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}})
	deadLetters(t, b, q, 1)
	for _, path := range []string{"/dlq?q=" + q, "/message?q=" + q + "&id=m0", "/export?q=" + q} {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, path)
		assert.Equal(t, "no-store", resp.Header.Get("Cache-Control"), path)
	}
}

// The confirmation of a large group (300,000 dead letters, each with a
// UUID for its id) carries every key it found: the form it posts is
// larger than net/http reads by default (10 MB), and is still taken, in
// a few seconds.
func TestConsoleLargeConfirmation(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	base := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}})
	deadLetters(t, b, q, 1) // for a page with a form
	_, page := getPage(t, base, "/dlq?q="+q)
	m := regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`).FindStringSubmatch(page)
	require.NotNil(t, m, "the form token in %s", page)
	const n = 300_000
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i)
	}
	keysJSON, err := json.Marshal(keys)
	require.NoError(t, err)
	form := url.Values{"csrf": {m[1]}, "q": {q}, "action": {"purge"}, "group": {"0123456789ab"}, "n": {strconv.Itoa(n)},
		"keys": {string(keysJSON)}}
	resp, err := http.PostForm(base+"/do", form)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	assert.Contains(t, string(body), "removed 0 message(s)")
}

// A page of another site that loads the console's pages without the
// operator (an image, a script, a frame, a fetch: a request its browser
// marks cross-site and not a navigation by the user) is refused before
// the dead-letter queue is read: each read takes every message and puts
// it back, marked redelivered, and a quorum dead-letter queue counts it
// as a delivery, which RabbitMQ 4.0 drops past 20. A link the operator
// follows from another site, and a request of a browser that sends no
// Sec-Fetch headers, are served.
func TestConsoleRefusesCrossSiteReads(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	base := serveConsole(t, b, consoleConfig{amqpURLs: []string{amqpURL}, queues: []string{q}})
	deadLetters(t, b, q, 1)
	get := func(path string, headers map[string]string) int {
		req, err := http.NewRequest(http.MethodGet, base+path, nil)
		require.NoError(t, err)
		for k, v := range headers {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp.StatusCode
	}
	image := map[string]string{"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"}
	scripted := map[string]string{"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
	followed := map[string]string{"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document", "Sec-Fetch-User": "?1"}
	for _, path := range []string{"/dlq?q=" + q, "/message?q=" + q + "&id=m0", "/export?q=" + q} {
		assert.Equal(t, http.StatusForbidden, get(path, image), "%s as an image of another site", path)
		assert.Equal(t, http.StatusForbidden, get(path, scripted), "%s opened by a script of another site", path)
	}
	// Not one of those reads took the dead letter.
	d, ok, err := b.Get(context.Background(), q+".dlq")
	require.NoError(t, err)
	require.True(t, ok)
	assert.False(t, d.Redelivered, "the dead letter was read by a refused request")
	require.NoError(t, d.Nack(false, true))

	assert.Equal(t, http.StatusOK, get("/dlq?q="+q, followed), "a link the operator followed")
	assert.Equal(t, http.StatusOK, get("/dlq?q="+q, map[string]string{"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "navigate"}), "the console's own link")
	assert.Equal(t, http.StatusOK, get("/dlq?q="+q, nil), "a client without Sec-Fetch headers")
}
