// Package s3test owns the real S3 server the tests of S3 blob stores run
// against: Versity Gateway (versitygw) with its posix backend, started
// on a free loopback port over a temporary directory, one per test
// process when the package's TestMain calls Main (else one per test),
// with a fresh bucket for each test; and a fault-injecting reverse proxy
// to put in front of it (proxy.go).
//
// The binary is looked for at $STASIS_VERSITYGW, then on PATH; `make
// deps-s3` builds it (go install github.com/versity/versitygw/cmd/versitygw
// at v1.8.0, into ~/.cache/stasis/go/versitygw-v1.8.0, which the Makefile
// puts on PATH). A missing binary fails the test, naming that fix: the S3
// tests are never skipped.
package s3test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"stasis/internal/testsvc"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"golang.org/x/sys/unix"
)

// Env names the variable that gives the versitygw binary's path.
const Env = "STASIS_VERSITYGW"

// Credentials of the server's root account.
const (
	AccessKey = "stasis-test-access"
	SecretKey = "stasis-test-secret-0123456789"
)

// startTimeout bounds the wait for a started server to answer.
const startTimeout = 30 * time.Second

// Server is a running versitygw.
type Server struct {
	// Endpoint is its URL, http://127.0.0.1:PORT.
	Endpoint string
	// Root is the posix backend's directory: bucket B's object O is the
	// file Root/B/O.
	Root string
	// Sidecar is the metadata directory when the temporary directory's
	// file system has no extended attributes ("" when it has).
	Sidecar string

	tmp  string
	cmd  *exec.Cmd
	done <-chan struct{} // closed when the process has exited
	log  *lockedBuffer
}

var (
	mainMu  sync.Mutex
	inMain  bool    // Main is running: Start shares one server
	shared  *Server // the shared server, once started
	sharedE error   // why it could not start
)

// Main runs the tests of a package whose tests share one server (started
// by the first Start), and stops it and removes its directory at the end.
// Call it from TestMain: func TestMain(m *testing.M) { s3test.Main(m) }.
func Main(m *testing.M) {
	mainMu.Lock()
	inMain = true
	mainMu.Unlock()
	code := m.Run()
	mainMu.Lock()
	if shared != nil {
		shared.Stop()
	}
	mainMu.Unlock()
	os.Exit(code)
}

// Start returns a running server: the process's shared one under Main,
// else one for t alone, stopped when t ends.
func Start(t testing.TB) *Server {
	t.Helper()
	mainMu.Lock()
	defer mainMu.Unlock()
	if !inMain {
		s, err := start()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		return s
	}
	if shared == nil && sharedE == nil {
		shared, sharedE = start()
	}
	if sharedE != nil {
		t.Fatal(sharedE)
	}
	return shared
}

// Binary returns the versitygw binary's path, or an error naming the fix.
func Binary() (string, error) {
	if p := os.Getenv(Env); p != "" {
		if fi, err := os.Stat(p); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return "", fmt.Errorf("$%s is %q, not an executable file: run make deps-s3, or point %s at a versitygw binary", Env, p, Env)
		}
		return p, nil
	}
	p, err := exec.LookPath("versitygw")
	if err != nil {
		return "", fmt.Errorf("versitygw (the S3 server the S3 tests run against) is neither at $%s nor on PATH: run make deps-s3 (it builds versitygw v1.8.0 into ~/.cache/stasis/go/versitygw-v1.8.0, which make puts on PATH), or set %s to its path", Env, Env)
	}
	return p, nil
}

// start starts a server on a free loopback port, trying another port if
// the one chosen was taken meanwhile.
func start() (*Server, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	var last error
	for try := 0; try < 3; try++ {
		s, err := startOnce(bin)
		if err == nil {
			return s, nil
		}
		last = err
	}
	return nil, last
}

func startOnce(bin string) (*Server, error) {
	tmp, err := os.MkdirTemp("", "stasis-s3test-")
	if err != nil {
		return nil, fmt.Errorf("s3test: %w", err)
	}
	s := &Server{tmp: tmp, Root: filepath.Join(tmp, "root"), log: &lockedBuffer{}}
	fail := func(err error) (*Server, error) {
		os.RemoveAll(tmp)
		return nil, err
	}
	if err := os.Mkdir(s.Root, 0o700); err != nil {
		return fail(fmt.Errorf("s3test: %w", err))
	}
	args := []string{"--port", "", "--quiet", "posix"}
	// The posix backend keeps objects' metadata in extended attributes;
	// where the file system has none, in a sidecar directory.
	if !hasXattrs(s.Root) {
		s.Sidecar = filepath.Join(tmp, "sidecar")
		if err := os.Mkdir(s.Sidecar, 0o700); err != nil {
			return fail(fmt.Errorf("s3test: %w", err))
		}
		args = append(args, "--sidecar", s.Sidecar)
	}
	args = append(args, s.Root)
	port, err := freePort()
	if err != nil {
		return fail(fmt.Errorf("s3test: a free port: %w", err))
	}
	addr := net.JoinHostPort("127.0.0.1", port)
	args[1] = addr
	s.Endpoint = "http://" + addr
	s.cmd = exec.Command(bin, args...)
	// The documented way to give the root account (not on the command
	// line, where ps shows it).
	s.cmd.Env = append(os.Environ(), "ROOT_ACCESS_KEY="+AccessKey, "ROOT_SECRET_KEY="+SecretKey)
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	// A shared service of the test process (testsvc): a test binary that
	// dies takes the server along (parent-death signal), and the checks
	// that a test left no process behind look past it.
	svc, err := testsvc.Start("versitygw", s.cmd, "", syscall.SIGTERM)
	if err != nil {
		return fail(fmt.Errorf("s3test: %w", err))
	}
	s.done = svc.Done()
	if err := s.waitReady(); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

// waitReady polls the server until it answers HTTP, it exits, or the
// start timeout passes.
func (s *Server) waitReady() error {
	deadline := time.Now().Add(startTimeout)
	client := &http.Client{Timeout: time.Second}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		resp, err := client.Get(s.Endpoint + "/")
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			return nil
		}
		select {
		case <-s.done:
			return fmt.Errorf("s3test: versitygw exited before it answered at %s: %s", s.Endpoint, s.log.String())
		case <-tick.C:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("s3test: versitygw did not answer at %s within %s: %v; its output: %s", s.Endpoint, startTimeout, err, s.log.String())
		}
	}
}

// Stop kills the server (its process, by pid) and removes its directory.
func (s *Server) Stop() {
	select {
	case <-s.done:
	default:
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.done:
		case <-time.After(5 * time.Second):
			_ = s.cmd.Process.Kill()
			<-s.done
		}
	}
	os.RemoveAll(s.tmp)
}

// Pid is the server process's id.
func (s *Server) Pid() int { return s.cmd.Process.Pid }

// Client is a client of the server with the root account's credentials.
func (s *Server) Client(t testing.TB) *minio.Client {
	t.Helper()
	c, err := minio.New(strings.TrimPrefix(s.Endpoint, "http://"), &minio.Options{
		Creds:        credentials.NewStaticV4(AccessKey, SecretKey, ""),
		Region:       "us-east-1",
		BucketLookup: minio.BucketLookupPath,
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Bucket creates a fresh bucket for t, removed (with what is in it) when t
// ends.
func (s *Server) Bucket(t testing.TB) string {
	t.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "t-" + hex.EncodeToString(b)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Client(t).MakeBucket(ctx, name, minio.MakeBucketOptions{}); err != nil {
		t.Fatalf("s3test: make bucket %s: %v", name, err)
	}
	t.Cleanup(func() {
		// The posix backend's bucket is a directory: removing it removes
		// the bucket and everything in it at once.
		os.RemoveAll(filepath.Join(s.Root, name))
		if s.Sidecar != "" {
			os.RemoveAll(filepath.Join(s.Sidecar, name))
		}
	})
	return name
}

// Setenv points the AWS environment variables at the server, for t.
func (s *Server) Setenv(t testing.TB) {
	t.Helper()
	t.Setenv("AWS_ENDPOINT_URL_S3", s.Endpoint)
	t.Setenv("AWS_ENDPOINT_URL", "")
	t.Setenv("AWS_ACCESS_KEY_ID", AccessKey)
	t.Setenv("AWS_SECRET_ACCESS_KEY", SecretKey)
	t.Setenv("AWS_SESSION_TOKEN", "")
	t.Setenv("AWS_REGION", "us-east-1")
}

// ObjectPath is the file that holds object name of bucket.
func (s *Server) ObjectPath(bucket, name string) string {
	return filepath.Join(s.Root, bucket, filepath.FromSlash(name))
}

// hasXattrs reports whether dir's file system takes user extended
// attributes.
func hasXattrs(dir string) bool {
	p := filepath.Join(dir, ".xattr-probe")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		return false
	}
	defer os.Remove(p)
	err := unix.Setxattr(p, "user.stasis-probe", []byte("1"), 0)
	return !errors.Is(err, unix.ENOTSUP) && err == nil
}

// freePort returns a loopback TCP port nobody listens on (now).
func freePort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	_, port, err := net.SplitHostPort(l.Addr().String())
	return port, err
}

// lockedBuffer collects the server's output, bounded.
type lockedBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.b) < 64<<10 {
		l.b = append(l.b, p...)
	}
	return len(p), nil
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.b)
}
