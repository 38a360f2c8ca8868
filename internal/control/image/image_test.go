package image_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"stasis/internal/control/image"
)

const idBase = 1 << 30

// entry is one tar entry of a test layer.
type entry struct {
	name, link string
	typ        byte
	mode       int64
	uid, gid   int
	body       string
	xattr      map[string]string
}

func layerOf(t *testing.T, es ...entry) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mt := time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)
	for _, e := range es {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid, ModTime: mt, Size: int64(len(e.body)), Format: tar.FormatPAX}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		if e.typ == tar.TypeChar {
			h.Devmajor, h.Devminor = 1, 3
		}
		for k, v := range e.xattr {
			if h.PAXRecords == nil {
				h.PAXRecords = map[string]string{}
			}
			h.PAXRecords["SCHILY.xattr."+k] = v
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			if _, err := io.WriteString(tw, e.body); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func imageOf(t *testing.T, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config.Env = []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"}
	cf.Config.WorkingDir = "/srv"
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// testImage has two layers: the upper one removes a file and empties a
// directory of the lower one, and replaces a file.
func testImage(t *testing.T) v1.Image {
	lower := layerOf(t,
		entry{name: "etc/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "etc/os-release", typ: tar.TypeReg, mode: 0o644, body: "ID=test\n"},
		entry{name: "etc/shadow", typ: tar.TypeReg, mode: 0o600, body: "root:*:1::::::\n"},
		entry{name: "etc/gone", typ: tar.TypeReg, mode: 0o644, body: "lower\n"},
		entry{name: "etc/replaced", typ: tar.TypeReg, mode: 0o644, body: "lower\n"},
		entry{name: "cache/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "cache/old", typ: tar.TypeReg, mode: 0o644, body: "old\n"},
		entry{name: "home/user/", typ: tar.TypeDir, mode: 0o750, uid: 1000, gid: 1000},
		entry{name: "home/user/notes", typ: tar.TypeReg, mode: 0o640, uid: 1000, gid: 1000, body: "mine\n", xattr: map[string]string{"user.origin": "test"}},
		entry{name: "usr/bin/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "usr/bin/su", typ: tar.TypeReg, mode: 0o4755, body: "#!/bin/sh\n"},
		entry{name: "usr/bin/big-id", typ: tar.TypeReg, mode: 0o644, uid: 100000, gid: 100000, body: "x"},
		entry{name: "usr/lib/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "lib", typ: tar.TypeSymlink, link: "usr/lib"},
		entry{name: "bin", typ: tar.TypeSymlink, link: "usr/bin"},
		entry{name: "dev/", typ: tar.TypeDir, mode: 0o755},
		entry{name: "dev/null", typ: tar.TypeChar, mode: 0o666},
		entry{name: "run/fifo", typ: tar.TypeFifo, mode: 0o600},
	)
	upper := layerOf(t,
		entry{name: "etc/.wh.gone", typ: tar.TypeReg},
		entry{name: "etc/replaced", typ: tar.TypeReg, mode: 0o600, body: "upper\n"},
		entry{name: "cache/.wh..wh..opq", typ: tar.TypeReg},
		entry{name: "cache/new", typ: tar.TypeReg, mode: 0o644, body: "new\n"},
		entry{name: "lib/libx.so", typ: tar.TypeReg, mode: 0o644, body: "elf\n"},
		entry{name: "usr/bin/su-link", typ: tar.TypeLink, link: "usr/bin/su"},
		entry{name: "usr/bin/sh", typ: tar.TypeSymlink, link: "/bin/dash"},
	)
	return imageOf(t, lower, upper)
}

func openStore(t *testing.T) (*image.Store, string) {
	t.Helper()
	home := t.TempDir()
	s, err := image.Open(home, idBase)
	if err != nil {
		t.Fatal(err)
	}
	return s, home
}

func writeLayout(t *testing.T, img v1.Image, tag string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "layout")
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := lp.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": tag})); err != nil {
		t.Fatal(err)
	}
	return dir
}

func stat(t *testing.T, p string) *syscall.Stat_t {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t)
}

// checkTree checks the unpacked test image.
func checkTree(t *testing.T, im image.Image) {
	t.Helper()
	r := im.Root
	read := func(p string) string {
		b, err := os.ReadFile(filepath.Join(r, p))
		if err != nil {
			t.Errorf("%s: %v", p, err)
		}
		return string(b)
	}
	if got := read("etc/os-release"); got != "ID=test\n" {
		t.Errorf("os-release: %q", got)
	}
	if got := read("etc/replaced"); got != "upper\n" {
		t.Errorf("the upper layer's file: %q", got)
	}
	for _, gone := range []string{"etc/gone", "cache/old", "etc/.wh.gone", "cache/.wh..wh..opq", "dev/null"} {
		if _, err := os.Lstat(filepath.Join(r, gone)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s is there (%v)", gone, err)
		}
	}
	if got := read("cache/new"); got != "new\n" {
		t.Errorf("cache/new: %q", got)
	}
	// The upper layer's lib/ is a directory: it hides the lower's link,
	// as an overlay does.
	if got := read("lib/libx.so"); got != "elf\n" {
		t.Errorf("lib/libx.so: %q", got)
	}
	if l, err := os.Readlink(filepath.Join(r, "bin")); err != nil || l != "usr/bin" {
		t.Errorf("bin: %q %v", l, err)
	}
	if l, err := os.Readlink(filepath.Join(r, "usr/bin/sh")); err != nil || l != "/bin/dash" {
		t.Errorf("usr/bin/sh: %q %v", l, err)
	}
	su, link := stat(t, filepath.Join(r, "usr/bin/su")), stat(t, filepath.Join(r, "usr/bin/su-link"))
	if su.Ino != link.Ino {
		t.Errorf("su-link is not a hard link of su")
	}
	if su.Mode&0o7777 != 0o4755 || su.Uid != idBase {
		t.Errorf("su: mode %o uid %d", su.Mode&0o7777, su.Uid)
	}
	if st := stat(t, filepath.Join(r, "etc/shadow")); st.Mode&0o777 != 0o600 || st.Uid != idBase || st.Gid != idBase {
		t.Errorf("shadow: mode %o owner %d:%d", st.Mode&0o777, st.Uid, st.Gid)
	}
	if st := stat(t, filepath.Join(r, "home/user")); st.Mode&0o777 != 0o750 || st.Uid != idBase+1000 {
		t.Errorf("home/user: mode %o uid %d", st.Mode&0o777, st.Uid)
	}
	if st := stat(t, filepath.Join(r, "home/user/notes")); st.Uid != idBase+1000 || st.Gid != idBase+1000 || time.Unix(st.Mtim.Sec, 0).UTC().Year() != 2024 {
		t.Errorf("notes: owner %d:%d mtime %v", st.Uid, st.Gid, time.Unix(st.Mtim.Sec, 0))
	}
	if st := stat(t, filepath.Join(r, "home/user")); time.Unix(st.Mtim.Sec, 0).UTC().Year() != 2024 {
		t.Errorf("a directory's time was not kept: %v", time.Unix(st.Mtim.Sec, 0))
	}
	if st := stat(t, filepath.Join(r, "usr/bin/big-id")); st.Uid != idBase+65534 {
		t.Errorf("an id past the range: uid %d, want nobody's", st.Uid)
	}
	if st := stat(t, filepath.Join(r, "run/fifo")); st.Mode&unix.S_IFMT != unix.S_IFIFO {
		t.Errorf("run/fifo: mode %o", st.Mode)
	}
	buf := make([]byte, 64)
	if n, err := unix.Getxattr(filepath.Join(r, "home/user/notes"), "user.origin", buf); err != nil || string(buf[:n]) != "test" {
		t.Errorf("xattr: %q %v", buf[:n], err)
	}
	if im.Devices != 1 {
		t.Errorf("devices left out: %d", im.Devices)
	}
	if im.WorkingDir != "/srv" || len(im.Env) != 2 {
		t.Errorf("config: %+v", im)
	}
}

// TestEveryFormRoundTrips: the same image from a layout, a docker save
// archive and a registry on loopback has one digest and is unpacked once.
func TestEveryFormRoundTrips(t *testing.T) {
	ctx := context.Background()
	img := testImage(t)
	want, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	s, _ := openStore(t)

	dir := writeLayout(t, img, "v1")
	im, err := s.Pull(ctx, "oci:"+dir+":v1", nil)
	if err != nil {
		t.Fatal(err)
	}
	if im.Digest != want.String() {
		t.Fatalf("digest %s, want %s", im.Digest, want)
	}
	checkTree(t, im)
	first := stat(t, im.Root).Ino

	// docker save's format, written by go-containerregistry's tarball.
	archive := filepath.Join(t.TempDir(), "img.tar")
	tag, err := name.NewTag("example.test/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	if err := tarball.WriteToFile(archive, tag, img); err != nil {
		t.Fatal(err)
	}
	checkArchive(t, archive)
	im2, err := s.Pull(ctx, "docker-archive:"+archive, nil)
	if err != nil {
		t.Fatal(err)
	}
	if im2.Digest != im.Digest || stat(t, im2.Root).Ino != first {
		t.Errorf("the archive's image was unpacked again: %s at %s", im2.Digest, im2.Root)
	}

	reg := httptest.NewServer(registry.New())
	defer reg.Close()
	u, _ := url.Parse(reg.URL)
	ref, err := name.ParseReference(u.Host + "/team/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	im3, err := s.Pull(ctx, "docker://"+u.Host+"/team/app:v1", nil)
	if err != nil {
		t.Fatal(err)
	}
	if im3.Digest != im.Digest || stat(t, im3.Root).Ino != first {
		t.Errorf("the registry's image was unpacked again")
	}
	if len(im3.Refs) != 3 || im3.Ref() != "docker://"+u.Host+"/team/app:v1" {
		t.Errorf("refs: %v", im3.Refs)
	}
	// A fresh store pulls from the registry on its own.
	s2, _ := openStore(t)
	im4, err := s2.Resolve(ctx, "docker://"+u.Host+"/team/app:v1", nil)
	if err != nil {
		t.Fatal(err)
	}
	checkTree(t, im4)
	got, err := s2.Resolve(ctx, im4.Digest, nil)
	if err != nil || got.Root != im4.Root {
		t.Errorf("resolve by digest: %+v %v", got, err)
	}
	l, err := s.List()
	if err != nil || len(l) != 1 {
		t.Errorf("list: %v %v", l, err)
	}
}

// checkArchive checks that the archive is docker save's format.
func checkArchive(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("no manifest.json in the archive (%v)", err)
		}
		if h.Name == "manifest.json" {
			b, _ := io.ReadAll(tr)
			if !strings.Contains(string(b), `"RepoTags":["example.test/app:v1"]`) {
				t.Errorf("manifest.json: %s", b)
			}
			return
		}
	}
}

func TestParseRefRefusals(t *testing.T) {
	for _, bad := range []string{"", "ubuntu", "oci:", "docker-archive:", "docker://", "docker://UPPER/x:1", "sha256:12", "sha256:" + strings.Repeat("G", 64), "ftp://x"} {
		if _, err := image.ParseRef(bad); err == nil {
			t.Errorf("%q was accepted", bad)
		}
	}
	r, err := image.ParseRef("oci:/a/b:c:v2")
	if err != nil || r.Path != "/a/b:c" || r.Tag != "v2" {
		t.Errorf("oci with a colon: %+v %v", r, err)
	}
}

// TestHostileLayers: entries that try to leave the root are refused or
// kept inside it, and an image that fails to unpack leaves nothing.
func TestHostileLayers(t *testing.T) {
	ctx := context.Background()
	outside := t.TempDir()
	cases := map[string][]entry{
		"absolute link as a directory": {
			{name: "evil", typ: tar.TypeSymlink, link: outside},
			{name: "evil/planted", typ: tar.TypeReg, mode: 0o644, body: "x"},
		},
		"link up and out": {
			{name: "a/", typ: tar.TypeDir, mode: 0o755},
			{name: "a/up", typ: tar.TypeSymlink, link: "../../../../../../.." + outside},
			{name: "a/up/planted", typ: tar.TypeReg, mode: 0o644, body: "x"},
		},
		"dot-dot name": {
			{name: "../../../../../../.." + outside + "/planted", typ: tar.TypeReg, mode: 0o644, body: "x"},
		},
		"hard link out": {
			{name: "h", typ: tar.TypeLink, link: "../../../../../../etc/passwd"},
		},
	}
	for what, es := range cases {
		t.Run(what, func(t *testing.T) {
			s, home := openStore(t)
			dir := writeLayout(t, imageOf(t, layerOf(t, es...)), "bad")
			_, err := s.Pull(ctx, "oci:"+dir, nil)
			t.Logf("pull: %v", err)
			if _, err := os.Lstat(filepath.Join(outside, "planted")); err == nil {
				t.Fatalf("a file was written outside the image's root")
			}
			if err == nil {
				// Accepted only when kept inside (a link Extract dropped).
				return
			}
			l, _ := s.List()
			ents, _ := os.ReadDir(filepath.Join(home, "images"))
			for _, e := range ents {
				if !strings.HasSuffix(e.Name(), ".lock") {
					t.Errorf("a failed pull left %s", e.Name())
				}
			}
			if len(l) != 0 {
				t.Errorf("a failed pull is listed: %v", l)
			}
		})
	}
}

// TestInterruptedUnpackLeavesNothing: a pull cancelled part way leaves
// nothing a later pull would trust; GC removes its remains.
func TestInterruptedUnpackLeavesNothing(t *testing.T) {
	var es []entry
	for i := 0; i < 2000; i++ {
		es = append(es, entry{name: "f/" + strings.Repeat("x", 10) + string(rune('a'+i%26)) + "/" + time.Duration(i).String(), typ: tar.TypeReg, mode: 0o644, body: strings.Repeat("y", 4096)})
	}
	img := imageOf(t, layerOf(t, es...))
	dir := writeLayout(t, img, "big")
	s, home := openStore(t)
	ctx, cancel := context.WithCancel(context.Background())
	_, err := s.Pull(ctx, "oci:"+dir, func(bytes int64, files int) {
		if files > 100 {
			cancel()
		}
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled pull: %v", err)
	}
	d, _ := img.ConfigName()
	if _, err := s.Get(d.String()); !errors.Is(err, image.ErrNotFound) {
		t.Errorf("after an interrupted unpack: %v", err)
	}
	// What a killed process would leave: a half-written temporary tree.
	left := filepath.Join(home, "images", ".unpack-"+strings.Replace(d.String(), ":", "-", 1)+"-123")
	if err := os.MkdirAll(filepath.Join(left, "rootfs", "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(left); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("gc left an interrupted unpack: %v", err)
	}
	im, err := s.Pull(context.Background(), "oci:"+dir, nil)
	if err != nil || im.Files != 2000 {
		t.Fatalf("pull after the interruption: %+v %v", im.Files, err)
	}
}

// TestRemoveAndGCKeepWhatIsUsed: an image in use is neither removed nor
// collected; one not in use is.
func TestRemoveAndGCKeepWhatIsUsed(t *testing.T) {
	ctx := context.Background()
	s, _ := openStore(t)
	a, err := s.Pull(ctx, "oci:"+writeLayout(t, testImage(t), "a"), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Pull(ctx, "oci:"+writeLayout(t, imageOf(t, layerOf(t, entry{name: "only-b", typ: tar.TypeReg, mode: 0o644, body: "b"})), "b"), nil)
	if err != nil {
		t.Fatal(err)
	}
	inUse := func(d string) (string, error) {
		if d == a.Digest {
			return "sandbox sb-1 runs on it", nil
		}
		return "", nil
	}
	if err := s.Remove(a.Digest, inUse); !errors.Is(err, image.ErrInUse) || !strings.Contains(err.Error(), "sb-1") {
		t.Errorf("remove an image in use: %v", err)
	}
	removed, err := s.GC(inUse)
	if err != nil || len(removed) != 1 || removed[0] != b.Digest {
		t.Errorf("gc: %v %v", removed, err)
	}
	if _, err := s.Get(a.Digest); err != nil {
		t.Errorf("gc removed an image in use: %v", err)
	}
	if err := s.Remove(b.Digest, nil); !errors.Is(err, image.ErrNotFound) {
		t.Errorf("remove a removed image: %v", err)
	}
	if err := s.Remove(a.Digest, nil); err != nil {
		t.Fatal(err)
	}
	if l, _ := s.List(); len(l) != 0 {
		t.Errorf("left: %v", l)
	}
}

// TestCorruptLayerRefused: a layer whose bytes do not match its digest is
// refused and leaves nothing.
func TestCorruptLayerRefused(t *testing.T) {
	img := testImage(t)
	dir := writeLayout(t, img, "v1")
	ls, _ := img.Layers()
	d, _ := ls[0].Digest()
	blob := filepath.Join(dir, "blobs", "sha256", d.Hex)
	b, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(blob, b[:len(b)/2], 0o644); err != nil {
		t.Fatal(err)
	}
	s, _ := openStore(t)
	if _, err := s.Pull(context.Background(), "oci:"+dir, nil); err == nil {
		t.Fatal("a truncated layer was unpacked")
	}
	if l, _ := s.List(); len(l) != 0 {
		t.Errorf("listed after a failed pull: %v", l)
	}
}
