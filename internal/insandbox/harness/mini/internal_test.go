package mini

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestDecodeArgs(t *testing.T) {
	type args struct {
		Path *string `json:"path"`
	}
	for _, c := range []struct {
		raw, path, err string
	}{
		{`"{\"path\":\"a.txt\"}"`, "a.txt", ""},
		{`{"path":"b.txt","extra":1}`, "b.txt", ""}, // an object, from lenient servers; unknown fields ignored
		{`""`, "", ""},
		{`null`, "", ""},
		{`"{not json"`, "", "not valid"},
		{`"[1]"`, "", "must be a JSON object"},
		{`"{\"path\":3}"`, "", "not valid"},
	} {
		var a args
		err := decodeArgs(json.RawMessage(c.raw), &a)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%s: error %v, want %q", c.raw, err, c.err)
			}
			continue
		}
		got := ""
		if a.Path != nil {
			got = *a.Path
		}
		if err != nil || got != c.path {
			t.Errorf("%s: %q, %v", c.raw, got, err)
		}
	}
}

func TestHeadTail(t *testing.T) {
	h := newHeadTail(10)
	for _, p := range []string{"abc", "defgh", "ijklmnop", "qrstuvwxyz"} {
		_, _ = h.Write([]byte(p))
	}
	if got := h.String(); !strings.HasPrefix(got, "abcde\n[... 16 bytes of output left out") || !strings.HasSuffix(got, "...]\nvwxyz") {
		t.Errorf("%q", got)
	}
	h = newHeadTail(10)
	_, _ = h.Write([]byte("0123456789"))
	if got := h.String(); got != "0123456789" {
		t.Errorf("%q", got)
	}
}
