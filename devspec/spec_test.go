package devspec

import "testing"

func TestParseSize(t *testing.T) {
	good := map[string]uint64{"4096": 4096, "512K": 512 << 10, "64M": 64 << 20, "1G": 1 << 30,
		"1GiB": 1 << 30, "2t": 2 << 40, "1P": 1 << 50, "10MB": 10 << 20}
	for s, want := range good {
		if got, err := ParseSize(s); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "0", "G", "-1G", "1X", "99999999999P", "1.5G"} {
		if _, err := ParseSize(s); err == nil {
			t.Errorf("ParseSize(%q) accepted", s)
		}
	}
}

func TestParse(t *testing.T) {
	for in, want := range map[string]string{
		"img":            "rbd/img",
		"rbd:p/ns/img@s": "p/ns/img@s",
		"rbd-sync:p/img": "rbd-sync:p/img",
		"mem:64M":        "mem:64M",
		"file:/tmp/x":    "file:/tmp/x",
	} {
		s, err := Parse(in)
		if err != nil || s.String() != want {
			t.Errorf("Parse(%q) = %q, %v; want %q", in, s.String(), err, want)
		}
	}
	for _, in := range []string{"", "mem:", "mem:lots", "nbd:p/img", "rbd:a/b/c/d", "p//img"} {
		if _, err := Parse(in); err == nil {
			t.Errorf("Parse(%q) accepted", in)
		}
	}
}
