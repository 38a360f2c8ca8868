// Package pgtest owns the real PostgreSQL server stasis's tests run
// against: one per test process, from Debian's postgresql package, made by
// initdb in a temporary directory and run by pg_ctl's postgres as an
// unprivileged user (the postgres account when the tests run as root),
// listening on a unix socket in that directory only. Each test gets a
// database of its own, dropped when the test ends. The package's TestMain
// must stop the server: stasistest.Main or testsvc.Main does.
package pgtest

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"stasis/internal/testsvc"
)

// Server is a running PostgreSQL server.
type Server struct {
	// Dir holds the data directory and the server's unix socket.
	Dir string
	// Port is the number in the socket's name (.s.PGSQL.PORT); the server
	// listens on no TCP port.
	Port  int
	svc   *testsvc.Service
	admin *sql.DB
}

// Options tune the server a test starts with StartServer.
type Options struct {
	// Durable keeps fsync on, for benchmarks of commit latency; the shared
	// server runs with fsync off (a test's crash is a process's, never the
	// machine's, so nothing a committed transaction wrote is lost).
	Durable bool
}

var (
	shared     *Server
	sharedErr  error
	sharedOnce sync.Once
	dbSeq      atomic.Int64

	durable     *Server
	durableErr  error
	durableOnce sync.Once
)

// Shared returns the test process's server, starting it the first time.
func Shared(t testing.TB) *Server {
	t.Helper()
	sharedOnce.Do(func() { shared, sharedErr = StartServer(Options{}) })
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	if gone, err := shared.svc.Exited(); gone {
		t.Fatalf("the test PostgreSQL server has exited (%v); its log is %s", err, filepath.Join(shared.Dir, "log"))
	}
	return shared
}

// SharedDurable returns the test process's durable server (fsync on, as
// Options.Durable), starting it the first time: the server for benchmarks
// of commit latency. It runs beside Shared's, in a directory of its own.
func SharedDurable(t testing.TB) *Server {
	t.Helper()
	durableOnce.Do(func() { durable, durableErr = StartServer(Options{Durable: true}) })
	if durableErr != nil {
		t.Fatal(durableErr)
	}
	if gone, err := durable.svc.Exited(); gone {
		t.Fatalf("the durable test PostgreSQL server has exited (%v); its log is %s", err, filepath.Join(durable.Dir, "log"))
	}
	return durable
}

// DurableDSN is DSN on the durable server (SharedDurable).
func DurableDSN(t testing.TB) string {
	t.Helper()
	return SharedDurable(t).NewDatabase(t)
}

// DSN makes a new, empty database on the shared server for the test and
// returns its connection URL (postgres://…); the database is dropped when
// the test ends, whatever is still connected to it.
func DSN(t testing.TB) string {
	t.Helper()
	return Shared(t).NewDatabase(t)
}

// NewDatabase makes a new, empty database for the test and returns its URL.
func (s *Server) NewDatabase(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("t%d_%d", os.Getpid(), dbSeq.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := s.admin.ExecContext(ctx, `CREATE DATABASE `+name); err != nil {
		t.Fatalf("create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if _, err := s.admin.ExecContext(ctx, `DROP DATABASE `+name+` WITH (FORCE)`); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	return s.URL(name)
}

// URL is the connection URL of database name on the server.
func (s *Server) URL(name string) string {
	q := url.Values{"host": {s.Dir}, "port": {strconv.Itoa(s.Port)}, "sslmode": {"disable"}}
	return (&url.URL{Scheme: "postgres", User: url.User(superuser), Path: "/" + name, RawQuery: q.Encode()}).String()
}

// superuser is the role initdb makes.
const superuser = "stasis"

// BinDir finds PostgreSQL's server programs: $STASIS_PG_BINDIR, else the
// newest /usr/lib/postgresql/VERSION/bin (Debian's layout).
func BinDir() (string, error) {
	if d := os.Getenv("STASIS_PG_BINDIR"); d != "" {
		return d, nil
	}
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	sort.Slice(found, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(found[i]))))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(found[j]))))
		return vi < vj
	})
	if len(found) == 0 {
		return "", fmt.Errorf("PostgreSQL's server is not installed (no /usr/lib/postgresql/*/bin/initdb): run make deps, which installs Debian's postgresql package, or set STASIS_PG_BINDIR")
	}
	return filepath.Dir(found[len(found)-1]), nil
}

// StartServer starts a PostgreSQL server of its own in a new temporary
// directory; testsvc.StopAll stops it and removes the directory.
func StartServer(o Options) (*Server, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	// As root the server runs as the postgres account, which must reach
	// the directory: /tmp, whatever $TMPDIR says (a test's own temporary
	// directory is root's alone).
	parent := ""
	if os.Geteuid() == 0 {
		parent = "/tmp"
	}
	dir, err := os.MkdirTemp(parent, "stasis-pg-")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*Server, error) {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	cred, err := runAs(dir)
	if err != nil {
		return fail(err)
	}
	data := filepath.Join(dir, "data")
	initdb := exec.Command(filepath.Join(bin, "initdb"), "-D", data, "-U", superuser, "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Env = append(os.Environ(), "LC_ALL=C")
	if out, err := initdb.CombinedOutput(); err != nil {
		return fail(fmt.Errorf("initdb %s: %v: %s", data, err, out))
	}
	logf, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		return fail(err)
	}
	defer logf.Close()
	if cred != nil {
		_ = logf.Chown(int(cred.Uid), int(cred.Gid))
	}
	port := 5432
	args := []string{"-D", data, "-k", dir, "-p", strconv.Itoa(port),
		"-c", "listen_addresses=", "-c", "max_connections=300", "-c", "shared_buffers=64MB"}
	if !o.Durable {
		args = append(args, "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "synchronous_commit=off")
	}
	cmd := exec.Command(filepath.Join(bin, "postgres"), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	cmd.Env = append(os.Environ(), "LC_ALL=C")
	cmd.Stdout, cmd.Stderr = logf, logf
	svc, err := testsvc.Start("postgres", cmd, dir, syscall.SIGINT) // SIGINT: fast shutdown
	if err != nil {
		return fail(err)
	}
	s := &Server{Dir: dir, Port: port, svc: svc}
	if s.admin, err = sql.Open("pgx", s.URL("postgres")); err != nil {
		return nil, err
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := s.admin.PingContext(ctx)
		cancel()
		if err == nil {
			return s, nil
		}
		if gone, werr := svc.Exited(); gone {
			log, _ := os.ReadFile(filepath.Join(dir, "log"))
			return nil, fmt.Errorf("postgres exited at start (%v): %s", werr, log)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("postgres in %s does not answer after 2 minutes: %v", dir, err)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

// runAs returns the credentials to run the server with, and gives dir to
// that user: PostgreSQL refuses to run as root, so as root it runs as the
// postgres account (made by Debian's package); otherwise as the caller.
func runAs(dir string) (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL will not run as root, and there is no postgres account to run it as (%v): install Debian's postgresql package (make deps)", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		return nil, err
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}
