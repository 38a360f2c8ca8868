package stasistest

import (
	"archive/tar"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"stasis/internal/control/image"
)

// tmpRoot is the temporary directory as the process started: what the
// helpers build once per process must outlive a test that points TMPDIR
// at its own temporary directory (t.Setenv).
var tmpRoot = os.TempDir()

// ImageEnv names the OCI image the tests run sandboxes on (oci:PATH:TAG;
// the Makefile builds a Debian one and exports it).
const ImageEnv = "STASIS_TEST_IMAGE"

// TestImage is $STASIS_TEST_IMAGE, or a fatal error saying how to get one.
func TestImage(tb testing.TB) string {
	tb.Helper()
	ref := os.Getenv(ImageEnv)
	if ref == "" {
		tb.Fatalf("%s is not set: `make test` builds the Debian test image and sets it (or run `make deps-image` and export %s=oci:.tools/image/debian:stasis)", ImageEnv, ImageEnv)
	}
	return ref
}

// BusyboxText is what /etc/os-release holds in BusyboxImage.
const BusyboxText = "ID=stasis-busybox"

var busyboxImage = oncePerProcess(buildBusybox)

// BusyboxImage makes, once per test process, a small OCI image layout of
// the host's static busybox (busybox-static, which make installs): every
// applet a link in /bin, /etc/os-release holding BusyboxText, and
// /usr/bin/id a setuid-root copy of busybox (its id applet). It returns its reference.
func BusyboxImage(tb testing.TB) string {
	tb.Helper()
	return busyboxImage(tb)
}

func buildBusybox() (string, error) {
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		return "", fmt.Errorf("the busybox test image needs a static busybox at /bin/busybox (apt-get install busybox-static; make does): %w", err)
	}
	out, err := exec.Command("/bin/busybox", "--list").Output()
	if err != nil {
		return "", fmt.Errorf("busybox --list: %w", err)
	}
	return buildImage("busybox", image.ImportConfig{Env: []string{"PATH=/bin:/usr/bin"}}, func(add addFunc) {
		for _, d := range []string{"bin", "etc", "usr", "usr/bin", "root", "home", "var", "var/empty"} {
			add(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: 0o755}, nil)
		}
		add(&tar.Header{Name: "bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755}, bb)
		for _, a := range strings.Fields(string(out)) {
			if a != "busybox" {
				add(&tar.Header{Name: "bin/" + a, Typeflag: tar.TypeSymlink, Linkname: "busybox"}, nil)
			}
		}
		add(&tar.Header{Name: "usr/bin/id", Typeflag: tar.TypeReg, Mode: 0o4755}, bb)
		add(&tar.Header{Name: "etc/os-release", Typeflag: tar.TypeReg, Mode: 0o644}, []byte(BusyboxText+"\nNAME=busybox\n"))
		add(&tar.Header{Name: "etc/passwd", Typeflag: tar.TypeReg, Mode: 0o644}, []byte("root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/home/agent:/bin/sh\n"))
		add(&tar.Header{Name: "etc/shadow", Typeflag: tar.TypeReg, Mode: 0o600}, []byte("root:*:19000:0:99999:7:::\n"))
	})
}

// addFunc adds one entry (body for a regular file) to an image's layer.
type addFunc func(h *tar.Header, body []byte)

// buildImage writes the entries fill adds as one layer, imports it as an
// OCI layout tagged name in a directory removed after the tests, and
// returns its reference.
func buildImage(name string, cfg image.ImportConfig, fill func(add addFunc)) (string, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mt := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	var err error
	fill(func(h *tar.Header, body []byte) {
		h.ModTime, h.Size = mt, int64(len(body))
		if err == nil {
			err = tw.WriteHeader(h)
		}
		if err == nil && len(body) > 0 {
			_, err = tw.Write(body)
		}
	})
	if err == nil {
		err = tw.Close()
	}
	if err != nil {
		return "", fmt.Errorf("the %s test image: %w", name, err)
	}
	dir, err := os.MkdirTemp(tmpRoot, "stasis-"+name+"-image-")
	if err != nil {
		return "", err
	}
	addCleanup(func() { os.RemoveAll(dir) })
	tarPath := filepath.Join(dir, "rootfs.tar")
	if err := os.WriteFile(tarPath, buf.Bytes(), 0o644); err != nil {
		return "", err
	}
	layout := filepath.Join(dir, "layout")
	if _, err := image.Import(tarPath, layout, name, cfg); err != nil {
		return "", err
	}
	return "oci:" + layout + ":" + name, nil
}

var bareImage = oncePerProcess(buildBare)

// BareImage makes, once per test process, an OCI image layout with no
// program at all: /etc/passwd, /etc/os-release (BareText) and empty /work,
// /home/agent and /tmp. No sh, cat or tar: whatever a provider does in a
// sandbox on it, the in-sandbox binary must do.
func BareImage(tb testing.TB) string {
	tb.Helper()
	return bareImage(tb)
}

// BareText is what /etc/os-release holds in BareImage.
const BareText = "ID=stasis-bare"

func buildBare() (string, error) {
	return buildImage("bare", image.ImportConfig{}, func(add addFunc) {
		for _, d := range []string{"etc", "home", "home/agent"} {
			add(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: 0o755}, nil)
		}
		add(&tar.Header{Name: "etc/os-release", Typeflag: tar.TypeReg, Mode: 0o644}, []byte(BareText+"\n"))
		add(&tar.Header{Name: "etc/passwd", Typeflag: tar.TypeReg, Mode: 0o644}, []byte("root:x:0:0:root:/root:/nonexistent\nagent:x:1000:1000:agent:/home/agent:/nonexistent\n"))
	})
}
