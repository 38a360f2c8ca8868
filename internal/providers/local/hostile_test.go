package local_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/sandbox"
)

// These tests act as the agent in a sandbox (issue 18's findings) and are
// refused.

func run(t *testing.T, p *local.Provider, id string, u sandbox.User, script string) (string, int) {
	t.Helper()
	var out strings.Builder
	res, err := p.Exec(context.Background(), id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, User: u, Stdout: &out, Stderr: &out})
	if err != nil {
		t.Fatalf("exec %q: %v\n%s", script, err, out.String())
	}
	return out.String(), res.ExitCode
}

func newSandbox(t *testing.T, p *local.Provider) string {
	t.Helper()
	ctx := context.Background()
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Delete(ctx, info.ID) })
	return info.ID
}

// TestAgentIsNotRoot: the agent runs as an unprivileged uid of the
// sandbox's own user namespace, which is no host uid of note, and stasis's
// own user (root inside) is not the host's root either.
func TestAgentIsNotRoot(t *testing.T) {
	t.Parallel()
	p, home := newProvider(t, nil)
	id := newSandbox(t, p)
	out, code := run(t, p, id, sandbox.UserAgent, `id -u; id -g; id -G; grep -E '^(CapEff|CapBnd)' /proc/self/status; touch /work/by-agent; echo "$HOME"`)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if lines[0] != "1000" || lines[1] != "1000" || lines[2] != "1000" {
		t.Errorf("the agent's ids: %q", lines[:3])
	}
	for _, want := range []string{"CapEff:\t0000000000000000", "CapBnd:\t0000000000000000"} {
		if !strings.Contains(out, want) {
			t.Errorf("the agent has capabilities: want %q in\n%s", want, out)
		}
	}
	fi, err := os.Stat(filepath.Join(home, "sandboxes", "local", id, "root", "work", "by-agent"))
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != local.DefaultUIDBase+1000 || st.Gid != local.DefaultUIDBase+1000 {
		t.Errorf("a file the agent made is owned by host %d:%d, want %d", st.Uid, st.Gid, local.DefaultUIDBase+1000)
	}
	// /tmp is shared by both users: sticky, so neither can replace the
	// other's names in it.
	if out, _ := run(t, p, id, sandbox.UserAgent, `stat -c %a /tmp`); strings.TrimSpace(out) != "1777" {
		t.Errorf("/tmp has mode %s, want 1777", out)
	}
	out, _ = run(t, p, id, sandbox.UserControl, `id -u; touch /tmp/by-control`)
	if strings.TrimSpace(out) != "0" {
		t.Errorf("the control user inside: %q", out)
	}
	fi, err = os.Stat(filepath.Join(home, "sandboxes", "local", id, "root", "tmp", "by-control"))
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != local.DefaultUIDBase {
		t.Errorf("a file stasis's user made is owned by host uid %d, want %d (not the host's root)", st.Uid, local.DefaultUIDBase)
	}
	// The agent cannot become root again: no setuid binary works, and
	// stasis's user keeps no capability outside its namespace.
	if out, code := run(t, p, id, sandbox.UserAgent, `su -c id root </dev/null 2>&1; sudo -n id 2>&1; echo done`); strings.Contains(out, "uid=0") || code != 0 {
		t.Errorf("the agent became root: %s", out)
	}
}

// TestAgentCannotReadHostSecrets: finding 3. The host's secrets are
// covered, root-owned private files are unreadable (their owner is not
// mapped into the namespace), and the directories that hold state are not
// there at all.
func TestAgentCannotReadHostSecrets(t *testing.T) {
	t.Parallel()
	p, home := newProvider(t, nil)
	_, otherHome := newProvider(t, nil) // another server's state directory
	// A task file with a gold patch, given on the host (--tasks).
	tasks := filepath.Join(t.TempDir(), "swe.jsonl")
	if err := os.WriteFile(tasks, []byte(`{"instance_id":"x","patch":"GOLD-PATCH"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	id := newSandbox(t, p)
	for _, u := range []sandbox.User{sandbox.UserAgent, sandbox.UserControl} {
		out, _ := run(t, p, id, u, `
			echo "shadow=$(cat /etc/shadow 2>/dev/null | wc -c)"
			cat /etc/security/opasswd >/dev/null 2>&1 && echo opasswd-read || echo opasswd-refused
			for d in /root /home /var /run /srv /opt /mnt /media `+home+` `+otherHome+` `+tasks+` `+filepath.Dir(tasks)+`; do [ "$d" != "$HOME" ] && [ -e "$d" ] && echo "visible $d"; done
			grep -rl GOLD-PATCH /tmp /work "$HOME" /etc 2>/dev/null | sed 's/^/found: /' | head -1
			echo end`)
		if !strings.Contains(out, "shadow=0\n") {
			t.Errorf("%q: /etc/shadow could be read in the sandbox:\n%s", u, out)
		}
		if _, err := os.Stat("/etc/security/opasswd"); err == nil && !strings.Contains(out, "opasswd-refused") {
			t.Errorf("%q: a root-only host file was read:\n%s", u, out)
		}
		if strings.Contains(out, "visible ") || strings.Contains(out, "found: ") {
			t.Errorf("%q: host directories outside the allow-list are visible:\n%s", u, out)
		}
	}
}

// testGateway answers every request on a sandbox's socket with the
// sandbox's id.
type testGateway struct {
	mu   sync.Mutex
	srvs map[string]*http.Server
}

func (g *testGateway) ServeSandbox(id string, ln net.Listener) {
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "gateway for "+id) })}
	g.mu.Lock()
	if g.srvs == nil {
		g.srvs = map[string]*http.Server{}
	}
	g.srvs[id] = srv
	g.mu.Unlock()
	go func() { _ = srv.Serve(ln) }()
}

func (g *testGateway) StopSandbox(id string) {
	g.mu.Lock()
	srv := g.srvs[id]
	delete(g.srvs, id)
	g.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
	}
}

// TestGatewaySocketIsTheSandboxsOwn: finding 1. Each sandbox reaches the
// gateway on a socket of its own; stasis's user in it can call it, the
// agent cannot even reach it, and nobody inside can replace or remove it.
func TestGatewaySocketIsTheSandboxsOwn(t *testing.T) {
	t.Parallel()
	gwDir, err := os.MkdirTemp("", "stasis-gw-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(gwDir) })
	gw := &testGateway{}
	p, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, GatewayDir: gwDir, Gateway: gw})
	if err != nil {
		t.Fatal(err)
	}
	a, b := newSandbox(t, p), newSandbox(t, p)
	sock := local.GatewayDirInSandbox + "/" + local.GatewaySocketName
	call := `curl -sS --max-time 5 --unix-socket ` + sock + ` http://gw/ 2>&1; echo`
	if out, _ := run(t, p, a, sandbox.UserControl, call); !strings.Contains(out, "gateway for "+a) {
		t.Fatalf("stasis's user in %s cannot call its gateway: %s", a, out)
	}
	if out, _ := run(t, p, b, sandbox.UserControl, call); !strings.Contains(out, "gateway for "+b) {
		t.Fatalf("stasis's user in %s cannot call its gateway: %s", b, out)
	}
	// The agent: no call, no replacing, no removing, no other socket.
	for _, script := range []string{
		call,
		`mv ` + sock + ` /tmp/moved 2>&1; rm -f ` + sock + ` 2>&1; ls -la ` + local.GatewayDirInSandbox + ` 2>&1; echo end`,
		`python3 -c 'import socket,os; s=socket.socket(socket.AF_UNIX); s.bind("` + local.GatewayDirInSandbox + `/evil.sock")' 2>&1; echo end`,
	} {
		out, _ := run(t, p, a, sandbox.UserAgent, script)
		if strings.Contains(out, "gateway for") {
			t.Errorf("the agent reached the gateway: %s", out)
		}
	}
	// Nor can stasis's own user replace it (it is bound read-only).
	out, _ := run(t, p, a, sandbox.UserControl, `mv `+sock+` /tmp/moved 2>&1; rm -f `+sock+` 2>&1; touch `+local.GatewayDirInSandbox+`/x 2>&1; echo end`)
	if host, _ := p.GatewaySocket(a); !exists(host) {
		t.Fatalf("the socket was removed from inside: %s", out)
	}
	if out, _ := run(t, p, a, sandbox.UserControl, call); !strings.Contains(out, "gateway for "+a) {
		t.Errorf("after the attempts, the gateway does not answer: %s", out)
	}
	// A sandbox's directory is gone with it, and its socket is no longer
	// served.
	host, _ := p.GatewaySocket(b)
	if err := p.Delete(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	if exists(filepath.Dir(host)) {
		t.Errorf("the gateway directory of a deleted sandbox is still there")
	}
	gw.mu.Lock()
	_, served := gw.srvs[b]
	gw.mu.Unlock()
	if served {
		t.Errorf("the socket of a deleted sandbox is still served")
	}
}

func exists(p string) bool { _, err := os.Lstat(p); return err == nil }
