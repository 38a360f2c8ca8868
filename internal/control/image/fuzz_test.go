package image

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"stasis/errdefs"
)

// FuzzParseRef: any string parses or is refused as invalid, never
// panicking; a reference that parses prints as a string that parses
// back to the same reference.
func FuzzParseRef(f *testing.F) {
	for _, s := range []string{
		"", "oci:", "oci:/a/b", "oci:/a/b:v2", "oci:/a:b:c", "oci::x", "oci:a:", "oci:/x/y:tag/with/slash",
		"docker-archive:", "docker-archive:/tmp/img.tar", "docker://", "docker://registry.example/team/app:v1",
		"docker://registry.example/team/app@sha256:" + strings.Repeat("a", 64), "docker://UPPER/case", "sha256:",
		"sha256:" + strings.Repeat("0", 64), "sha256:" + strings.Repeat("A", 64), "ubuntu:22.04", "\x00", "oci:\x00:\xff",
		// The README's forms.
		"oci:.tools/image/debian:stasis", "oci:.tools/image/debian", "docker-archive:img.tar", "docker://registry.example:5000/library/debian:bookworm",
		"sha256:529ed47e" + strings.Repeat("0", 56), "oci:0::", "oci:a:b/c", "debian", "team/app",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		forms(t, s)
		r, err := ParseRef(s)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("ParseRef(%q): an error not of kind invalid: %v", s, err)
			}
			return
		}
		switch r.Transport {
		case TransportOCI, TransportArchive:
			if r.Path == "" {
				t.Fatalf("ParseRef(%q) = %+v: no path", s, r)
			}
		case TransportDocker:
			if r.Name == "" {
				t.Fatalf("ParseRef(%q) = %+v: no name", s, r)
			}
		case TransportDigest:
			if !digestRE.MatchString(r.Digest) {
				t.Fatalf("ParseRef(%q) = %+v: not a digest", s, r)
			}
		default:
			t.Fatalf("ParseRef(%q) = %+v: transport %q", s, r, r.Transport)
		}
		again, err := ParseRef(r.String())
		if err != nil || again != r {
			t.Fatalf("ParseRef(%q) = %+v prints as %q, which parses as %+v, %v", s, r, r.String(), again, err)
		}
	})
}

// forms checks that s, used as each part of the forms the README
// documents, comes back as that part: oci:PATH:TAG, oci:PATH (a path with
// no tag-like colon), docker-archive:PATH, docker://HOST/REPO:TAG and
// sha256:HEX.
func forms(t *testing.T, s string) {
	want := func(in string, w Ref) {
		t.Helper()
		if r, err := ParseRef(in); err != nil || r != w {
			t.Fatalf("ParseRef(%q) = %+v, %v; want %+v", in, r, err, w)
		}
	}
	if s == "" {
		return
	}
	if _, err := os.Stat(filepath.Join(s+":v1", "index.json")); err != nil {
		want("oci:"+s+":v1", Ref{Transport: TransportOCI, Path: s, Tag: "v1"})
	}
	if i := strings.LastIndexByte(s, ':'); i <= 0 || strings.Contains(s[i+1:], "/") {
		want("oci:"+s, Ref{Transport: TransportOCI, Path: s})
	}
	if !strings.Contains(s, "/") && !strings.Contains(s, ":") {
		want("oci:"+s+":"+s, Ref{Transport: TransportOCI, Path: s, Tag: s})
	}
	want("docker-archive:"+s, Ref{Transport: TransportArchive, Path: s})
	d := sha256.Sum256([]byte(s))
	want("sha256:"+hex.EncodeToString(d[:]), Ref{Transport: TransportDigest, Digest: "sha256:" + hex.EncodeToString(d[:])})
	if r, err := ParseRef("docker://registry.example/" + s + ":v1"); err == nil {
		if r != (Ref{Transport: TransportDocker, Name: "registry.example/" + s + ":v1"}) {
			t.Fatalf("ParseRef(docker://registry.example/%s:v1) = %+v", s, r)
		}
	} else if !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("ParseRef(docker://registry.example/%s:v1): an error not of kind invalid: %v", s, err)
	} else if simpleRepo.MatchString(s) {
		t.Fatalf("ParseRef(docker://registry.example/%s:v1) refused a plain repository: %v", s, err)
	}
}

// simpleRepo is a repository name every registry reference takes.
var simpleRepo = regexp.MustCompile(`^[a-z0-9]{1,64}(/[a-z0-9]{1,64}){0,3}$`)

// FuzzCleanTarPath: a tar entry's name becomes a path inside the root or
// is refused; it never names the root's parent or anything above it, and
// a name with no ".." component is never refused.
func FuzzCleanTarPath(f *testing.F) {
	for _, s := range []string{"", ".", "/", "a", "a/b", "/etc/passwd", "../x", "a/../../x", "a/..", "./a//b/", "..", "a/.wh.b", "...", "a/..b", "\x00", "//..",
		// Absolute names, symlink-like names (a link's name and a hard
		// link's target go through clean too), a backslash (no separator
		// in a tar name).
		"/", "//", "/../etc", "/a/./b", "evil/../../outside", "link/x", "./link/../../x", "..\\x", "a/\\..", "a/.", "./."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		rel, err := clean(name)
		dotdot := false
		for _, c := range strings.Split(name, "/") {
			dotdot = dotdot || c == ".."
		}
		if err != nil {
			if !dotdot {
				t.Fatalf("clean(%q) refused a name with no \"..\": %v", name, err)
			}
			return
		}
		if dotdot {
			t.Fatalf("clean(%q) = %q: a name with \"..\" was let through", name, rel)
		}
		if rel == "" || strings.HasPrefix(rel, "/") {
			t.Fatalf("clean(%q) = %q: not a relative path", name, rel)
		}
		// One name for one place: no empty, "." or ".." component (the
		// root itself is "."), and cleaning it again changes nothing, so
		// a hard link's target names the entry it was written as.
		if rel != "." {
			for _, c := range strings.Split(rel, "/") {
				if c == "" || c == "." || c == ".." {
					t.Fatalf("clean(%q) = %q: a component %q", name, rel, c)
				}
			}
		}
		if again, err := clean(rel); err != nil || again != rel {
			t.Fatalf("clean(%q) = %q, which cleans again to %q, %v", name, rel, again, err)
		}
		if abs, err := clean("/" + name); err != nil || abs != rel {
			t.Fatalf("clean(%q) = %q but clean(%q) = %q, %v: an absolute name is the same name in the root", name, rel, "/"+name, abs, err)
		}
		const root = "/root-of-image"
		if j := filepath.Join(root, rel); j != root && !strings.HasPrefix(j, root+"/") {
			t.Fatalf("clean(%q) = %q leaves the root: %s", name, rel, j)
		}
	})
}
