package agent

// Tests of the protocol's parsers, and of what cannot run for real on the
// host (setting the clock). Only the standard library and sandbox are
// imported here: this file is compiled into the package itself.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"stasis/errdefs"
	"stasis/internal/guestclock"
)

func TestFrames(t *testing.T) {
	var b []byte
	b = appendFrame(b, frameStdout, []byte("out"))
	b = appendFrame(b, frameStderr, nil)
	b = appendFrame(b, frameEnd, []byte(`{"exit_code":-15}`))
	r := bytes.NewReader(b)
	var buf []byte
	for _, want := range []struct {
		kind byte
		data string
	}{{frameStdout, "out"}, {frameStderr, ""}, {frameEnd, `{"exit_code":-15}`}} {
		kind, data, nb, err := readFrame(r, buf)
		buf = nb
		if err != nil || kind != want.kind || string(data) != want.data {
			t.Fatalf("frame %q %q %v, want %q %q", kind, data, err, want.kind, want.data)
		}
	}
	if _, _, _, err := readFrame(r, buf); err != io.EOF {
		t.Fatalf("after the last frame: %v", err)
	}
	for in, want := range map[string]string{
		"o\x00\x00":                 "unexpected EOF",
		"o\x00\x00\x00\x05abc":      "unexpected EOF",
		"z\x00\x00\x00\x00":         "unknown frame kind",
		"o\x00\x10\x00\x01" + "abc": "limit",
	} {
		if _, _, _, err := readFrame(strings.NewReader(in), nil); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("readFrame(%q) = %v, want an error containing %q", in, err, want)
		}
	}
	if e, err := parseEnd([]byte(`{"exit_code":-9,"kind":"timeout","error":"late"}`)); err != nil || e.ExitCode != -9 || e.Kind != "timeout" || e.Message != "late" {
		t.Fatalf("parseEnd: %+v %v", e, err)
	}
}

func TestParseExecHeader(t *testing.T) {
	h, err := parseExecHeader([]byte(`{"argv":["sh","-c","x"],"env":{"A":"1"},"cwd":"sub/../dir","timeout_ms":1500,"background":true,"log_path":"l"}` + "\n"))
	want := execHeader{Argv: []string{"sh", "-c", "x"}, Env: map[string]string{"A": "1"}, Cwd: "/work/dir", TimeoutMS: 1500, Background: true, LogPath: "l"}
	if err != nil || !reflect.DeepEqual(h, want) {
		t.Fatalf("parse: %+v %v", h, err)
	}
	if h.timeout() != 1500*time.Millisecond {
		t.Fatalf("timeout %s", h.timeout())
	}
	if h, err := parseExecHeader([]byte(`{"argv":["true"],"env":{}}`)); err != nil || h.Cwd != "/work" || h.Env != nil {
		t.Fatalf("defaults: %+v %v", h, err)
	}
	for in, want := range map[string]string{
		`{"argv":[]}`:                                  "no command",
		`{"argv":[""]}`:                                "no command",
		`{}`:                                           "no command",
		`{"argv":["a\u0000b"]}`:                        "NUL",
		`{"argv":["a"],"env":{"A=B":"x"}}`:             "environment variable",
		`{"argv":["a"],"env":{"":"x"}}`:                "environment variable",
		`{"argv":["a"],"cwd":"/a\u0000"}`:              "NUL",
		`{"argv":["a"],"timeout_ms":-1}`:               "out of range",
		`{"argv":["a"],"timeout_ms":1e3}`:              "bad header",
		`{"argv":["a"],"shell":true}`:                  "unknown field",
		`{"argv":["a"]} {"argv":["b"]}`:                "after the JSON value",
		`{"argv":["a"]`:                                "bad header",
		`{"argv":["a"],"timeout_ms":1e300}`:            "bad header",
		`{"argv":["a"],"timeout_ms":9223372036854775}`: "out of range",
	} {
		if _, err := parseExecHeader([]byte(in)); err == nil || !strings.Contains(err.Error(), want) || !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("parseExecHeader(%s) = %v, want an invalid error containing %q", in, err, want)
		}
	}
	// The header line ends at the first newline; what follows is stdin.
	br := bufio.NewReaderSize(strings.NewReader("{\"argv\":[\"cat\"]}\nstdin\nmore"), 16)
	line, err := readHeader(br)
	rest, _ := io.ReadAll(br)
	if err != nil || string(line) != "{\"argv\":[\"cat\"]}\n" || string(rest) != "stdin\nmore" {
		t.Fatalf("readHeader: %q %v, rest %q", line, err, rest)
	}
	if _, err := readHeader(bufio.NewReader(strings.NewReader(`{"argv":["cat"]}`))); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("a header with no newline: %v", err)
	}
	if _, err := readHeader(bufio.NewReader(strings.NewReader(strings.Repeat(" ", maxHeaderBytes+1) + "\n"))); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("a header too long: %v", err)
	}
}

func FuzzReadFrame(f *testing.F) {
	for _, s := range [][]byte{
		appendFrame(appendFrame(nil, frameStdout, []byte("hello\n")), frameEnd, []byte(`{"exit_code":0}`)),
		appendFrame(nil, frameStderr, nil),
		appendFrame(nil, frameEnd, []byte(`{"exit_code":-9,"kind":"timeout","error":"x"}`)),
		[]byte("o\x00\x00\x00\x05ab"),
		[]byte("q\x00\x00\x00\x00"),
		[]byte("o\xff\xff\xff\xff"),
		{},
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		var out, buf []byte
		for {
			kind, data, nb, err := readFrame(r, buf)
			buf = nb
			if err != nil {
				if err == io.EOF && len(out) != len(b) {
					t.Fatalf("EOF after %d of %d bytes", len(out), len(b))
				}
				return
			}
			if len(data) > maxFrameData {
				t.Fatalf("frame of %d bytes accepted", len(data))
			}
			// Re-encoding what was decoded gives back the input read so far.
			out = appendFrame(out, kind, data)
			if !bytes.Equal(out, b[:len(out)]) {
				t.Fatalf("decoded frames re-encode to %q, input %q", out, b[:len(out)])
			}
			if kind == frameEnd {
				if e, err := parseEnd(data); err == nil && e.Kind != "" {
					_ = e.toError("exec", "")
				}
			}
		}
	})
}

func FuzzParseExecHeader(f *testing.F) {
	for _, s := range []string{
		"{\"argv\":[\"sh\",\"-c\",\"echo hi\"]}\nstdin",
		"{\"argv\":[\"env\"],\"env\":{\"A\":\"1\",\"HOME\":\"/h\"},\"cwd\":\"/tmp\",\"timeout_ms\":100}\n",
		"{\"argv\":[\"x\"],\"background\":true,\"log_path\":\"/work/log/x.log\",\"cwd\":\"rel/../d\"}\n",
		"{\"argv\":[]}\n",
		"{\"argv\":[\"a\"]}",
		"\n",
		"{\"ARGV\":[\"a\"],\"Env\":{}}\n\n",
		"{\"argv\":[\"a\"],\"timeout_ms\":-5}\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		br := bufio.NewReaderSize(bytes.NewReader(b), 16)
		line, err := readHeader(br)
		if err != nil {
			return
		}
		if len(line) == 0 || line[len(line)-1] != '\n' || bytes.IndexByte(line, '\n') != len(line)-1 || !bytes.HasPrefix(b, line) {
			t.Fatalf("header line %q from %q", line, b)
		}
		if rest, _ := io.ReadAll(br); !bytes.Equal(rest, b[len(line):]) {
			t.Fatalf("stdin %q after header %q, want %q", rest, line, b[len(line):])
		}
		h, err := parseExecHeader(line)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("error of another kind: %v", err)
			}
			return
		}
		if (h.User != "" && h.User != "control") || len(h.Argv) == 0 || h.Argv[0] == "" || h.TimeoutMS < 0 || h.timeout() < 0 || !path.IsAbs(h.Cwd) || path.Clean(h.Cwd) != h.Cwd {
			t.Fatalf("accepted %+v", h)
		}
		env := h.environ(defaultHome)
		seen := map[string]bool{}
		for _, kv := range env {
			k, _, ok := strings.Cut(kv, "=")
			if !ok || k == "" || seen[k] || strings.IndexByte(kv, 0) >= 0 {
				t.Fatalf("environment %q", env)
			}
			seen[k] = true
		}
		if !seen["PATH"] || !seen["HOME"] {
			t.Fatalf("environment %q lacks the base", env)
		}
		// What the client would send for it parses to the same header.
		again, err := json.Marshal(h)
		if err != nil {
			t.Fatal(err)
		}
		h2, err := parseExecHeader(append(again, '\n'))
		if err != nil || !reflect.DeepEqual(h, h2) {
			t.Fatalf("round trip: %+v, then %+v %v", h, h2, err)
		}
	})
}

// TestClock runs the clock endpoint with stand-ins for the system's
// clocks: tests never set the host's clock.
func TestClock(t *testing.T) {
	s := newServer(slog.New(slog.DiscardHandler))
	var mu sync.Mutex
	var got []unix.Timespec
	// The guest's uptime reads 130.75 s; its wall clock, 2030-01-02.
	s.clocks = guestclock.Clocks{
		Boottime: func() (unix.Timespec, error) { return unix.Timespec{Sec: 130, Nsec: 750_000_000}, nil },
		Realtime: func() (unix.Timespec, error) { return unix.Timespec{Sec: 1_893_553_445}, nil },
		Settime: func(ts unix.Timespec) error {
			mu.Lock()
			defer mu.Unlock()
			got = append(got, ts)
			return nil
		},
	}
	hs := httptest.NewServer(s.handler())
	defer hs.Close()
	c := New(hs.URL)
	defer c.CloseIdle()
	c.What = "sandbox sb-test"
	ctx := context.Background()
	when := time.Date(2030, 1, 2, 3, 4, 5, 678_900_000, time.UTC)
	f, err := c.SetClock(ctx, guestclock.Target{Wall: float64(when.UnixNano()) / 1e9})
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if len(got) != 1 || got[0].Sec != when.Unix() || d(got[0].Nsec-int64(when.Nanosecond())) > 1000 {
		t.Fatalf("clock set to %+v, want %v", got, when)
	}
	mu.Unlock()
	if f.Uptime != 130.75 || f.Before != 1_893_553_445 {
		t.Fatalf("fix %+v", f)
	}
	// Continuous: the guest computes pause_wall + (uptime − pause_uptime)
	// from its own uptime.
	f, err = c.SetClock(ctx, guestclock.Target{Continuous: true, PauseWall: 1_800_000_000.25, PauseUptime: 100.5})
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if len(got) != 2 || got[1].Sec != 1_800_000_030 || d(got[1].Nsec-500_000_000) > 1000 || f.After != 1_800_000_030.5 {
		t.Fatalf("continuous: set to %+v, fix %+v", got, f)
	}
	mu.Unlock()
	for _, body := range []string{`{"wall":-1}`, `{"wall":0}`, `{"wall":"soon"}`, `{"wall":1e300}`, `{"when":5}`, ``,
		`{"continuous":true,"pause_wall":1800000000,"pause_uptime":500}`, `{"continuous":true,"pause_uptime":5}`} {
		resp, err := http.Post(hs.URL+"/v1/clock", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("clock %s: %s", body, resp.Status)
		}
	}
	mu.Lock()
	if len(got) != 2 {
		t.Fatalf("a refused request set the clock: %+v", got)
	}
	mu.Unlock()
	// A failing clock_settime is an error; the sandbox is named.
	s.clocks.Settime = func(unix.Timespec) error { return unix.EPERM }
	if _, err := c.SetClock(ctx, guestclock.Target{Wall: 1_900_000_000}); err == nil || !errors.Is(err, errdefs.ErrUnsupported) || !strings.Contains(err.Error(), "sandbox sb-test") || !strings.Contains(err.Error(), "not permitted") {
		t.Fatalf("failing clock: %v", err)
	}
}

func d(n int64) int64 {
	if n < 0 {
		return -n
	}
	return n
}

// TestErrorsOnTheWire checks the kinds of error the client gives back.
func TestErrorsOnTheWire(t *testing.T) {
	hs := httptest.NewServer(newServer(slog.New(slog.DiscardHandler)).handler())
	defer hs.Close()
	c := New(hs.URL)
	defer c.CloseIdle()
	ctx := context.Background()
	// An agent too old to know a path.
	if _, err := c.do(ctx, "future", http.MethodGet, "/v1/future", nil, nil, http.StatusOK); !errors.Is(err, errdefs.ErrUnsupported) {
		t.Errorf("unknown path: %v", err)
	}
	// A bad exec header sent past the client's own checks.
	for _, body := range []string{"{\"argv\":[]}\n", "{\"argv\":[\"a\"],\"nope\":1}\n", "no newline"} {
		if _, err := c.do(ctx, "exec", http.MethodPost, "/v1/exec", nil, strings.NewReader(body), http.StatusOK); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("exec body %q: %v", body, err)
		}
	}
	x := t.TempDir() + "/x"
	for _, q := range []string{"", "?path=", "?path=" + x + "&mode=999", "?path=" + x + "&mode=abc"} {
		req, _ := http.NewRequest(http.MethodPut, hs.URL+"/v1/file"+q, strings.NewReader("x"))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("write %q: %s", q, resp.Status)
		}
	}
	for _, we := range []wireError{{"not_found", "m"}, {"invalid", "m"}, {"timeout", "m"}, {"unsupported", "m"}} {
		err := we.toError("op", "sandbox x")
		if toWire(err) != we || !strings.HasPrefix(err.Error(), "op sandbox x: ") {
			t.Errorf("%+v → %v → %+v", we, err, toWire(err))
		}
	}
	if err := (wireError{"internal", "boom"}).toError("op", ""); err.Error() != "op: agent: boom" {
		t.Errorf("internal error: %v", err)
	}
}
