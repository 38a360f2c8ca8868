package local_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/local"
	"stasis/internal/stasistest"
	"stasis/sandbox"
	"stasis/sandbox/sandboxtest"
)

// newImageProvider opens a local provider whose sandboxes' in-sandbox
// binary is the static one.
func newImageProvider(t *testing.T, hook func(string, int) error) (*local.Provider, string) {
	t.Helper()
	home := t.TempDir()
	p, err := local.New(local.Options{Home: home, Exe: stasistest.Exe(), ExeEnv: stasistest.Env, ForkHook: hook, SandboxBinary: stasistest.StaticBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	return p, home
}

func conformanceWithImage(t *testing.T, ref, file, text string) {
	var mu sync.Mutex
	fail := map[string]int{}
	p, home := newImageProvider(t, func(snapshot string, i int) error {
		mu.Lock()
		defer mu.Unlock()
		if k, ok := fail[snapshot]; ok && k == i {
			return errors.New("injected fork failure")
		}
		return nil
	})
	// Pulled first, as `stasis image pull` would: the suite's short leases
	// must not include the unpack.
	start := time.Now()
	im, err := p.Images().Pull(context.Background(), ref, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("unpacked %s: %d bytes in %d files (%s)", ref, im.Bytes, im.Files, time.Since(start).Round(time.Millisecond))
	sandboxtest.Run(t, sandboxtest.Harness{
		Provider: p,
		FailFork: func(snapshot string, k int) func() {
			mu.Lock()
			fail[snapshot] = k
			mu.Unlock()
			return func() { mu.Lock(); delete(fail, snapshot); mu.Unlock() }
		},
		Retired:       p.Retired,
		HostProcesses: func(id string) []int { return hostProcesses(filepath.Join(home, "sandboxes", "local", id)) },
		Image:         ref, ImageFile: file, ImageText: text,
		// The host has bubblewrap; neither image does.
		HostOnly: "/usr/bin/bwrap",
	})
}

// TestConformanceWithDebianImage: the whole suite, and its image cases,
// on the Debian image the Makefile builds.
func TestConformanceWithDebianImage(t *testing.T) {
	conformanceWithImage(t, stasistest.TestImage(t), "/etc/os-release", "ID=debian")
}

// TestConformanceWithBusyboxImage: the same on an image with nothing but a
// static busybox (no setpriv, env or sleep of the host's).
func TestConformanceWithBusyboxImage(t *testing.T) {
	conformanceWithImage(t, stasistest.BusyboxImage(t), "/etc/os-release", stasistest.BusyboxText)
}

// TestImageSandboxIsolation: with an image, the agent is uid 1000 with
// no_new_privs, every mount of the image is nosuid (so the image's setuid
// root files give nothing), the host's files are not there, and root's
// files of the image are closed to the agent.
func TestImageSandboxIsolation(t *testing.T) {
	t.Parallel()
	p, _ := newImageProvider(t, nil)
	info, err := p.Create(context.Background(), sandbox.Spec{Image: stasistest.BusyboxImage(t), Expiry: time.Now().Add(5 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(context.Background(), info.ID)
	out, code := run(t, p, info.ID, sandbox.UserAgent, `id -u; grep NoNewPrivs /proc/self/status; /usr/bin/id -u; cat /etc/shadow 2>&1; ls /usr/bin/bwrap 2>&1; ls /root/.cache 2>&1; exit 0`)
	t.Logf("exit %d:\n%s", code, out)
	lines := strings.Split(out, "\n")
	if len(lines) < 3 || lines[0] != "1000" || !strings.Contains(lines[1], "1") || lines[2] != "1000" {
		t.Errorf("the agent's uid, no_new_privs and a setuid root file's effect:\n%s", out)
	}
	if !strings.Contains(out, "Permission denied") || strings.Contains(out, "root:*") {
		t.Errorf("the agent read the image's /etc/shadow:\n%s", out)
	}
	if strings.Count(out, "No such file") < 2 {
		t.Errorf("a host path shows in the sandbox:\n%s", out)
	}
	mounts, _ := run(t, p, info.ID, sandbox.UserAgent, `cat /proc/self/mountinfo`)
	seen := 0
	for _, l := range strings.Split(mounts, "\n") {
		f := strings.Fields(l)
		if len(f) < 6 {
			continue
		}
		switch {
		case f[4] == "/bin" || f[4] == "/etc" || f[4] == "/usr" || f[4] == local.EnterBinary:
			seen++
			if !strings.Contains(f[5], "nosuid") || !strings.Contains(f[5], "ro") {
				t.Errorf("the image's %s is mounted %s, not read-only and nosuid", f[4], f[5])
			}
		}
	}
	if seen != 4 {
		t.Errorf("found %d of the image's mounts and the in-sandbox binary's, want 4:\n%s", seen, mounts)
	}
}

// TestMissingImageSaysSo: a digest that is not in the store is refused
// with the way to get it, and leaves no sandbox.
func TestMissingImageSaysSo(t *testing.T) {
	t.Parallel()
	p, _ := newImageProvider(t, nil)
	_, err := p.Create(context.Background(), sandbox.Spec{Image: "sha256:" + strings.Repeat("ab", 32), Expiry: time.Now().Add(time.Minute)})
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "stasis image pull") {
		t.Errorf("create on a missing image: %v", err)
	}
	if _, err := p.Create(context.Background(), sandbox.Spec{Image: "no-such-form", Expiry: time.Now().Add(time.Minute)}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("create on a bad reference: %v", err)
	}
	if l, _ := p.List(context.Background(), nil); len(l) != 0 {
		t.Errorf("a refused create left %v", l)
	}
}

// TestFilesOnABareImage: on an image with no program at all (no sh, cat or
// tar), files still go in and out: an upload and a download round-trip a
// tree with a link, and a read and a write through a link that leaves
// /work (so they run inside the sandbox) work; an upload whose names
// leave the directory is refused and writes nothing outside it.
func TestFilesOnABareImage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p, _ := newImageProvider(t, nil)
	info, err := p.Create(ctx, sandbox.Spec{Image: stasistest.BareImage(t), Expiry: time.Now().Add(5 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, info.ID)
	var in bytes.Buffer
	tw := tar.NewWriter(&in)
	for _, f := range []struct {
		name, body, link string
		mode             int64
	}{
		{name: "./"}, {name: "./src/"}, {name: "./src/main.go", body: "package main\n", mode: 0o644},
		{name: "./run.sh", body: "#!/bin/sh\n", mode: 0o755}, {name: "./tmp-link", link: "/tmp/target"},
	} {
		h := &tar.Header{Name: f.name, Mode: f.mode, Size: int64(len(f.body)), Typeflag: tar.TypeReg}
		switch {
		case strings.HasSuffix(f.name, "/"):
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		case f.link != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f.link
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(f.body)); err != nil {
			t.Fatal(err)
		}
	}
	tw.Close()
	if err := p.Upload(ctx, info.ID, "/work/tree", &in); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := p.Download(ctx, info.ID, "/work/tree", &out); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	tr := tar.NewReader(&out)
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		b, _ := io.ReadAll(tr)
		got[h.Name] = fmt.Sprintf("%c %o %s%s", h.Typeflag, h.Mode&0o777, b, h.Linkname)
	}
	want := map[string]string{"./": "5 755 ", "./src/": "5 755 ", "./src/main.go": "0 644 package main\n", "./run.sh": "0 755 #!/bin/sh\n", "./tmp-link": "2 777 /tmp/target"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("download:\n%v\nwant\n%v", got, want)
	}
	// Through the link, which leaves /work for /tmp: done inside.
	if err := p.WriteFile(ctx, info.ID, "/work/tree/tmp-link", []byte("through\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := p.ReadFile(ctx, info.ID, "/work/tree/tmp-link"); err != nil || string(b) != "through\n" {
		t.Errorf("read through the link: %q %v", b, err)
	}
	if b, err := p.ReadFile(ctx, info.ID, "/tmp/target"); err != nil || string(b) != "through\n" {
		t.Errorf("the link's target: %q %v", b, err)
	}
	// A hostile archive: a link out, then a file through it.
	in.Reset()
	tw = tar.NewWriter(&in)
	_ = tw.WriteHeader(&tar.Header{Name: "out", Typeflag: tar.TypeSymlink, Linkname: "/tmp"})
	_ = tw.WriteHeader(&tar.Header{Name: "out/escaped", Typeflag: tar.TypeReg, Mode: 0o644, Size: 2})
	_, _ = tw.Write([]byte("x\n"))
	tw.Close()
	if err := p.Upload(ctx, info.ID, "/work/hostile", &in); err == nil || !strings.Contains(err.Error(), "out/escaped") {
		t.Errorf("an upload through a link out of its directory: %v", err)
	}
	if _, err := p.ReadFile(ctx, info.ID, "/tmp/escaped"); err == nil {
		t.Error("the hostile upload wrote /tmp/escaped")
	}
}
