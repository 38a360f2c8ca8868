package s3test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/testwait"

	"github.com/minio/minio-go/v7"
	"golang.org/x/sys/unix"
)

// These tests do not call Main: each Start is a server of its own, which
// the test's end stops.

// fatalRecorder is a testing.TB whose Fatal and Skip record what they are
// told and end the goroutine, as testing.T's do.
type fatalRecorder struct {
	testing.TB
	fatal, skip string
}

func (r *fatalRecorder) Helper()           {}
func (r *fatalRecorder) Fatal(args ...any) { r.fatal = sprint(args...); panic(r) }
func (r *fatalRecorder) Skip(args ...any)  { r.skip = sprint(args...); panic(r) }
func (r *fatalRecorder) Cleanup(func())    {}

func sprint(args ...any) string {
	var b strings.Builder
	for _, a := range args {
		if err, ok := a.(error); ok {
			b.WriteString(err.Error())
		} else if s, ok := a.(string); ok {
			b.WriteString(s)
		}
	}
	return b.String()
}

// Without versitygw, Start fails the test (never skips it), naming the
// fix.
func TestMissingBinaryFailsNamingTheFix(t *testing.T) {
	for _, c := range []struct{ env, path string }{
		{filepath.Join(t.TempDir(), "no-versitygw"), os.Getenv("PATH")},
		{"", t.TempDir()},
	} {
		t.Setenv(Env, c.env)
		t.Setenv("PATH", c.path)
		if _, err := Binary(); err == nil || !strings.Contains(err.Error(), "make deps-s3") {
			t.Fatalf("Binary with %s=%q, PATH=%q: %v", Env, c.env, c.path, err)
		}
		r := &fatalRecorder{TB: t}
		func() {
			defer func() {
				if p := recover(); p != r {
					t.Fatalf("Start did not end the test: %v", p)
				}
			}()
			Start(r)
		}()
		if r.skip != "" || !strings.Contains(r.fatal, "make deps-s3") {
			t.Fatalf("Start without versitygw: fatal %q, skip %q; want a failure naming make deps-s3", r.fatal, r.skip)
		}
	}
}

// A server answers S3 on loopback, gives fresh buckets, and is gone, its
// process and its directory, when its test ends.
func TestServerLifecycle(t *testing.T) {
	var pid int
	var tmp, bucketDir string
	t.Run("server", func(t *testing.T) {
		s := Start(t)
		pid, tmp = s.Pid(), s.tmp
		if !strings.HasPrefix(s.Endpoint, "http://127.0.0.1:") {
			t.Fatalf("endpoint %s is not on loopback", s.Endpoint)
		}
		b1, b2 := s.Bucket(t), s.Bucket(t)
		if b1 == b2 {
			t.Fatal("two buckets with one name")
		}
		ctx := context.Background()
		c := s.Client(t)
		if _, err := c.PutObject(ctx, b1, "a/b", bytes.NewReader([]byte("hi")), 2, minio.PutObjectOptions{}); err != nil {
			t.Fatal(err)
		}
		if b, err := os.ReadFile(s.ObjectPath(b1, "a/b")); err != nil || string(b) != "hi" {
			t.Fatalf("the object's file: %q %v", b, err)
		}
		bucketDir = filepath.Join(s.Root, b1)
		t.Logf("versitygw pid %d on %s, root %s, sidecar %q", pid, s.Endpoint, s.Root, s.Sidecar)
	})
	if !gone(pid) {
		t.Errorf("the server (pid %d) outlived its test", pid)
	}
	for _, p := range []string{tmp, bucketDir} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s outlived its test: %v", p, err)
		}
	}
}

// The proxy forwards, fails, delays and cuts what its faults match, and
// logs every request.
func TestProxyFaults(t *testing.T) {
	s := Start(t)
	p := s.Proxy(t)
	get := func(ctx context.Context, path string) (int, []byte, error) {
		req, _ := http.NewRequestWithContext(ctx, "GET", p.URL+path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, b, err
	}
	ctx := context.Background()
	if code, _, err := get(ctx, "/"); err != nil || code != http.StatusForbidden { // unsigned: refused by the server
		t.Fatalf("forwarded: %d %v", code, err)
	}
	f := p.Inject(&Fault{Match: Matching("GET", "/fail"), Status: http.StatusServiceUnavailable, Times: 1})
	if code, body, _ := get(ctx, "/fail"); code != 503 || !strings.Contains(string(body), "<Code>SlowDown</Code>") {
		t.Fatalf("a failure: %d %s", code, body)
	}
	if code, _, _ := get(ctx, "/fail"); code == http.StatusServiceUnavailable || f.Hits() != 1 {
		t.Fatalf("after its one time, the fault still applies: %d, %d hits", code, f.Hits())
	}
	p.Inject(&Fault{Match: Matching("", "/slow"), Delay: time.Minute})
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	start := time.Now()
	_, _, err := get(cctx, "/slow")
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 5*time.Second {
		t.Fatalf("a delayed request: %v after %s", err, time.Since(start))
	}
	p.Inject(&Fault{Match: Matching("", "/drop"), Drop: true})
	if _, _, err := get(ctx, "/drop"); err == nil {
		t.Fatal("a dropped connection answered")
	}
	p.Inject(&Fault{Match: Matching("", "/cut"), Drop: true, DropAfter: 10})
	if _, body, err := get(ctx, "/cut"); err == nil || len(body) != 10 {
		t.Fatalf("a cut body: %d bytes, %v; want 10 and an error", len(body), err)
	}
	reqs := strings.Join(p.Requests(), "\n")
	for _, want := range []string{"GET /fail", "GET /slow", "GET /drop", "GET /cut"} {
		if !strings.Contains(reqs, want) {
			t.Errorf("the log lacks %q: %s", want, reqs)
		}
	}
}

// A test binary that dies, killed, takes its server along (Pdeathsig).
func TestServerDiesWithTestBinary(t *testing.T) {
	if os.Getenv("S3TEST_CHILD") == "1" {
		s, err := start()
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("server %d %s\n", s.Pid(), s.tmp)
		select {} // until killed
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestServerDiesWithTestBinary$", "-test.count=1")
	cmd.Env = append(os.Environ(), "S3TEST_CHILD=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var pid int
	var tmp string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if _, err := fmt.Sscanf(sc.Text(), "server %d %s", &pid, &tmp); err == nil {
			break
		}
	}
	if pid == 0 {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatal("the child test binary did not start a server")
	}
	t.Cleanup(func() { os.RemoveAll(tmp) }) // the killed child could not
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	testwait.Until(t, fmt.Sprintf("versitygw (pid %d) dies with its test binary", pid), 10*time.Second, func() bool {
		return gone(pid)
	})
}

// gone reports whether process pid has exited (a zombie nobody reaped
// counts as gone).
func gone(pid int) bool {
	if err := unix.Kill(pid, 0); errors.Is(err, unix.ESRCH) {
		return true
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// pid (comm) STATE ...
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && i+2 < len(s) && s[i+2] == 'Z'
}
