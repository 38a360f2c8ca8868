package killmatrix_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/control/server"
	"stasis/internal/proc"
	"stasis/internal/stasistest"
)

// serveProc is a `stasis serve` child (stasistest.Serve) for one test.
type serveProc struct {
	*stasistest.Serve
	t *testing.T
}

// startServe starts `stasis serve` on state with args and the extra
// environment env (the step gate's), logging at debug level.
func startServe(t *testing.T, state string, env []string, args ...string) *serveProc {
	t.Helper()
	s := stasistest.StartServeT(t, stasistest.ServeOptions{Env: env, Log: filepath.Join(t.TempDir(), "serve.log")},
		append([]string{"--state", state, "--log-level", "debug"}, args...)...)
	return &serveProc{Serve: s, t: t}
}

func (p *serveProc) logTail() string { return p.LogTail(40) }

// kill ends the server with SIGKILL, as a crash would.
func (p *serveProc) kill() { p.Kill() }

// stop ends the server with SIGTERM and expects exit 0.
func (p *serveProc) stop() {
	p.t.Helper()
	if err := p.Stop(30 * time.Second); err != nil {
		p.t.Fatal(err)
	}
}

// answer is an API call's status and body.
type answer struct {
	code int
	body []byte
	err  error
}

func (a answer) String() string {
	if a.err != nil {
		return a.err.Error()
	}
	return fmt.Sprintf("%d %s", a.code, bytes.TrimSpace(a.body))
}

// call calls the API of the server at addr (no *testing.T: it may run
// in a goroutine while the server is killed).
func call(addr, method, path string, body any) answer {
	var r io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		r = bytes.NewReader(b)
	} else if method == "POST" {
		r = strings.NewReader("{}")
	}
	q, err := http.NewRequest(method, "http://"+addr+path, r)
	if err != nil {
		return answer{err: err}
	}
	if method == "POST" {
		q.Header.Set("Content-Type", "application/json")
	}
	resp, err := (&http.Client{Timeout: 5 * time.Minute}).Do(q)
	if err != nil {
		return answer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{code: resp.StatusCode, body: b, err: err}
}

// must calls the API and fails the test unless the answer is want.
func (p *serveProc) must(method, path string, body any, want int, out any) {
	p.t.Helper()
	a := call(p.Addr, method, path, body)
	if a.err != nil || a.code != want {
		p.t.Fatalf("%s %s: %s, want %d; the server's log:\n%s", method, path, a, want, p.logTail())
	}
	if out != nil {
		if err := json.Unmarshal(a.body, out); err != nil {
			p.t.Fatalf("%s %s: %v", method, path, err)
		}
	}
}

func (p *serveProc) episode(id string) server.EpisodeView {
	p.t.Helper()
	var v server.EpisodeView
	p.must("GET", "/v1/episodes/"+id, nil, http.StatusOK, &v)
	return v
}

// holder holds every model request that is the third call of its
// conversation (two assistant messages before it) until released.
type holder struct {
	next     http.Handler
	mu       sync.Mutex
	arrived  chan struct{}
	release  chan struct{}
	released bool
	calls    int
	arrivals int // calls held so far
}

func newHolder(next http.Handler) *holder {
	return &holder{next: next, arrived: make(chan struct{}), release: make(chan struct{})}
}

func (h *holder) Release() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.released {
		h.released = true
		close(h.release)
	}
}

// Arrivals is how many calls the holder has held.
func (h *holder) Arrivals() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.arrivals
}

// Calls is how many model calls reached the model.
func (h *holder) Calls() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls
}

func (h *holder) ServeHTTP(w http.ResponseWriter, q *http.Request) {
	body, err := io.ReadAll(q.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req struct {
		Messages []struct {
			Role string `json:"role"`
		} `json:"messages"`
	}
	if json.Unmarshal(body, &req) == nil {
		assistant := 0
		for _, m := range req.Messages {
			if m.Role == "assistant" {
				assistant++
			}
		}
		if assistant == 2 {
			h.mu.Lock()
			h.arrivals++
			select {
			case <-h.arrived:
			default:
				close(h.arrived)
			}
			h.mu.Unlock()
			select {
			case <-h.release:
			case <-q.Context().Done(): // the gateway that asked is gone
				return
			}
		}
	}
	h.mu.Lock()
	h.calls++
	h.mu.Unlock()
	q.Body = io.NopCloser(bytes.NewReader(body))
	h.next.ServeHTTP(w, q)
}

// sandboxProc is a process of a sandbox made under a state directory, as
// the host sees it.
type sandboxProc struct {
	pid, ppid int
	nsPID     int    // its pid in the sandbox's namespace
	start     uint64 // its start time (clock ticks since boot)
	cmdline   string
}

// sandboxProcs lists the processes in sandboxes whose keeper or
// bubblewrap names state on its command line: each process in another
// pid namespace than the test's, below such a process.
func sandboxProcs(state string) []sandboxProc {
	all, err := proc.All()
	if err != nil {
		return nil
	}
	roots := map[int]bool{}
	for pid := range all {
		if strings.Contains(cmdline(pid), state) {
			roots[pid] = true
		}
	}
	under := func(pid int) bool {
		for n := 0; n < 64 && pid > 1; n++ {
			if roots[pid] {
				return true
			}
			pid = all[pid].PPID
		}
		return false
	}
	var out []sandboxProc
	for pid, st := range all {
		ns := nsPIDs(pid)
		if len(ns) < 2 || !under(st.PPID) {
			continue
		}
		out = append(out, sandboxProc{pid: pid, ppid: st.PPID, nsPID: ns[len(ns)-1], start: st.StartTime, cmdline: cmdline(pid)})
	}
	return out
}

func cmdline(pid int) string {
	b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	return strings.ReplaceAll(string(bytes.TrimRight(b, "\x00")), "\x00", " ")
}

// nsPIDs is a process's pid in each pid namespace it is in, outermost
// first (NSpid of /proc/PID/status).
func nsPIDs(pid int) []int {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return nil
	}
	for _, l := range strings.Split(string(b), "\n") {
		rest, ok := strings.CutPrefix(l, "NSpid:")
		if !ok {
			continue
		}
		var out []int
		for _, f := range strings.Fields(rest) {
			n, _ := strconv.Atoi(f)
			out = append(out, n)
		}
		return out
	}
	return nil
}

// alive reports whether pid is a process that is not a zombie.
func alive(pid int) bool {
	st, err := proc.ReadStat(pid)
	return err == nil && st.State != 'Z' && st.State != 'X'
}
