/*
 * The marker decoder of the Spark pipeline, in the JVM: one marker record value in, the rows of
 * the ``markers`` format out (docs/protocol.md, versions 1 and 2).
 *
 * Why it exists: decoding markers in Python (``mapInArrow`` with the C decoder) moves every
 * record from the JVM to a Python worker and every decoded column back; that round trip, not the
 * decoding, was 85 % of the decode step's time. Here the record never leaves the JVM.
 *
 * It implements exactly the rules of the C decoder (tracker/_speedups.c) with the same error
 * texts, and expands a range marker into one row per covered offset as ``marker_columns`` does;
 * tests/spark_pipeline/test_jvm_decoder.py checks that both give the same rows on valid,
 * corrupted and random values. pipeline/jvm_jar.py builds it (javac against PySpark's jars)
 * and registers it as the SQL function ``kmq_marker_rows``.
 *
 * Row fields, in order (the ``markers`` format after its record position and timestamp): kind,
 * group, topic, partition, offset, attempt, origin_topic, origin_partition, origin_offset,
 * timeout_ms, delay_ms, policy_delay, deferred, consumer, reason, error. A refused value is one
 * row with every field null but ``error``.
 */
package kmq.pipeline;

import java.nio.ByteBuffer;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CharsetDecoder;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.api.java.UDF1;

public final class MarkerRowsUdf implements UDF1<byte[], List<Row>> {
  private static final long serialVersionUID = 1L;

  private static final int HEAD_SIZE = 19;
  private static final int V2_HEAD_SIZE = 25;
  private static final int MAX_TOPIC = 249;
  private static final int MAX_GROUP = 255;
  private static final int MAX_CONSUMER = 255;
  private static final int MAX_REASON = 4096;
  private static final int FLAG_HAS_ORIGIN = 0x01;
  private static final int FLAG_POLICY_DELAY = 0x02;
  private static final int FLAG_DEFERRED = 0x04;
  private static final int KNOWN_FLAGS = 0x07;
  private static final int DELAY_FLAGS = FLAG_POLICY_DELAY | FLAG_DEFERRED;
  private static final long MAX_DELAY_MS = 315360000000L;
  private static final long MAX_RANGE_WIDTH = 65536L;
  private static final String[] KIND_NAMES = {null, "START", "ACK", "DELAY", "EXTEND", "REJECT"};

  /** A refused value: the reason, as the Python decoders word it. */
  private static final class Refused extends Exception {
    private static final long serialVersionUID = 1L;

    Refused(String message) {
      super(message, null, false, false); // no stack trace: garbage must stay cheap
    }
  }

  /** A one-entry cache of a decoded text field: a batch mostly repeats the same names. */
  private static final class TextCache {
    private byte[] raw = new byte[0];
    private String value;

    String get(byte[] v, int from, int len) {
      if (value != null && raw.length == len && Arrays.equals(raw, 0, len, v, from, from + len)) {
        return value;
      }
      return null;
    }

    String put(byte[] v, int from, int len, String text) {
      raw = Arrays.copyOfRange(v, from, from + len);
      value = text;
      return text;
    }
  }

  // One instance per task thread is not guaranteed, so the caches and the UTF-8 decoder are
  // per thread.
  private static final class State {
    // What the parts shared by both versions leave behind (one value at a time per thread).
    String topicName;
    String groupName;
    long timeoutMs;
    String consumerName;

    final TextCache topic = new TextCache();
    final TextCache originTopic = new TextCache();
    final TextCache group = new TextCache();
    final TextCache consumer = new TextCache();
    final CharsetDecoder utf8 =
        StandardCharsets.UTF_8
            .newDecoder()
            .onMalformedInput(CodingErrorAction.REPORT)
            .onUnmappableCharacter(CodingErrorAction.REPORT);
  }

  private static final ThreadLocal<State> STATE = ThreadLocal.withInitial(State::new);

  @Override
  public List<Row> call(byte[] value) {
    State state = STATE.get();
    try {
      if (value == null) {
        throw new Refused("a marker record must have a bytes value (got a tombstone?)");
      }
      if (value.length > 0 && value[0] == 2) {
        return decodeV2(state, value);
      }
      return Collections.singletonList(decodeV1(state, value));
    } catch (Refused refused) {
      return Collections.singletonList(
          RowFactory.create(
              null, null, null, null, null, null, null, null, null, null, null, null, null, null,
              null, refused.getMessage()));
    }
  }

  private static int u8(byte[] v, int p) {
    return v[p] & 0xFF;
  }

  private static int rd16(byte[] v, int p) {
    return (u8(v, p) << 8) | u8(v, p + 1);
  }

  private static int rd32(byte[] v, int p) {
    return (u8(v, p) << 24) | (u8(v, p + 1) << 16) | (u8(v, p + 2) << 8) | u8(v, p + 3);
  }

  private static long rdU32(byte[] v, int p) {
    return rd32(v, p) & 0xFFFFFFFFL;
  }

  private static long rd64(byte[] v, int p) {
    return ((long) rd32(v, p) << 32) | rdU32(v, p + 4);
  }

  private static boolean legalTopicByte(int c) {
    return (c >= 'a' && c <= 'z')
        || (c >= 'A' && c <= 'Z')
        || (c >= '0' && c <= '9')
        || c == '.'
        || c == '_'
        || c == '-';
  }

  /** Python's repr() of a str made of ASCII characters and U+FFFD, as the C decoder's %R. */
  static String pythonRepr(String s) {
    char quote = s.indexOf('\'') >= 0 && s.indexOf('"') < 0 ? '"' : '\'';
    StringBuilder out = new StringBuilder(s.length() + 2);
    out.append(quote);
    for (int i = 0; i < s.length(); i++) {
      char c = s.charAt(i);
      if (c == quote || c == '\\') {
        out.append('\\').append(c);
      } else if (c == '\t') {
        out.append("\\t");
      } else if (c == '\n') {
        out.append("\\n");
      } else if (c == '\r') {
        out.append("\\r");
      } else if (c < ' ' || c == 0x7f) {
        out.append(String.format("\\x%02x", (int) c));
      } else {
        out.append(c);
      }
    }
    return out.append(quote).toString();
  }

  private static String topic(TextCache cache, byte[] v, int from, int len) throws Refused {
    String cached = cache.get(v, from, len);
    if (cached != null) {
      return cached;
    }
    for (int i = 0; i < len; i++) {
      int c = u8(v, from + i);
      if (!legalTopicByte(c)) {
        if (c < 0x80) {
          int shown = Math.min(len, 60);
          StringBuilder text = new StringBuilder(shown);
          for (int j = 0; j < shown; j++) {
            int b = u8(v, from + j);
            text.append(b < 0x80 ? (char) b : '\uFFFD');
          }
          throw new Refused(pythonRepr(text.toString()) + " is not a legal Kafka topic name");
        }
        throw new Refused("topic name is not ASCII");
      }
    }
    if ((len == 1 && v[from] == '.') || (len == 2 && v[from] == '.' && v[from + 1] == '.')) {
      throw new Refused("'" + (len == 1 ? "." : "..") + "' is not a legal Kafka topic name");
    }
    return cache.put(v, from, len, new String(v, from, len, StandardCharsets.US_ASCII));
  }

  private static String text(State state, TextCache cache, byte[] v, int from, int len, String what)
      throws Refused {
    if (len == 0) {
      return "";
    }
    if (cache != null) {
      String cached = cache.get(v, from, len);
      if (cached != null) {
        return cached;
      }
    }
    for (int i = from; i < from + len; i++) {
      if (v[i] == 0) { // U+0000: no PostgreSQL text holds it (tracker/protocol_text.py)
        throw new Refused(what + " contains a NUL character (U+0000)");
      }
    }
    String decoded;
    try {
      CharBuffer chars = state.utf8.reset().decode(ByteBuffer.wrap(v, from, len));
      decoded = chars.toString();
    } catch (CharacterCodingException e) {
      throw new Refused(what + " is not valid UTF-8");
    }
    return cache != null && len <= 255 ? cache.put(v, from, len, decoded) : decoded;
  }

  /**
   * The topic (``topicLen`` bytes at ``head``) and the group after it, into ``state``; returns
   * the position after the group. The same in both versions but for where the topic starts.
   */
  private static int names(State state, byte[] v, int head, int topicLen) throws Refused {
    int pos = head + topicLen;
    if (pos + 2 > v.length) {
      throw new Refused("marker truncated in the topic");
    }
    state.topicName = topic(state.topic, v, head, topicLen);
    int groupLen = rd16(v, pos);
    int end = pos + 2 + groupLen;
    if (end > v.length || groupLen == 0 || groupLen > MAX_GROUP) {
      throw new Refused("group is empty, too long or truncated");
    }
    state.groupName = text(state, state.group, v, pos + 2, groupLen, "group");
    return end;
  }

  /** A START's tail (``u32 timeout_ms``, string consumer) at ``pos``; returns the end. */
  private static int startTail(State state, byte[] v, int pos, String kind) throws Refused {
    if (pos + 6 > v.length) {
      throw new Refused(kind + " marker truncated");
    }
    state.timeoutMs = rdU32(v, pos);
    int n = rd16(v, pos + 4);
    int end = pos + 6 + n;
    if (n > MAX_CONSUMER || end > v.length) {
      throw new Refused("consumer id too long or truncated");
    }
    state.consumerName = text(state, state.consumer, v, pos + 6, n, "consumer");
    return end;
  }

  /** An EXTEND's tail (``u32 timeout_ms``, at least 1) at ``pos``; returns the end. */
  private static int extendTail(State state, byte[] v, int pos, String kind) throws Refused {
    if (pos + 4 > v.length) {
      throw new Refused(kind + " marker truncated");
    }
    state.timeoutMs = rdU32(v, pos);
    if (state.timeoutMs == 0) {
      throw new Refused(kind + " must ask for a positive timeout");
    }
    return pos + 4;
  }

  private static Row decodeV1(State state, byte[] v) throws Refused {
    int size = v.length;
    if (size < HEAD_SIZE + 3) {
      if (size > 0 && v[0] != 1) {
        throw new Refused("unsupported marker version " + u8(v, 0));
      }
      throw new Refused("marker of " + size + " bytes is too short");
    }
    int version = u8(v, 0);
    int kind = u8(v, 1);
    int flags = u8(v, 2);
    int attempt = rd16(v, 3);
    int partition = rd32(v, 5);
    long offset = rd64(v, 9);
    int topicLen = rd16(v, 17);
    if (version != 1) {
      throw new Refused("unsupported marker version " + version);
    }
    if (kind < 1 || kind > 5) {
      throw new Refused("unknown marker kind " + kind);
    }
    if ((flags & ~KNOWN_FLAGS) != 0) {
      throw new Refused(String.format("unknown flag bits 0x%02x", flags));
    }
    if (attempt == 0) {
      throw new Refused("attempt must be >= 1");
    }
    if (partition < 0 || offset < 0) {
      throw new Refused("partition and offset must not be negative");
    }
    if (topicLen == 0 || topicLen > MAX_TOPIC) {
      throw new Refused("topic length " + topicLen + " is out of range");
    }
    int pos = names(state, v, HEAD_SIZE, topicLen);
    String topic = state.topicName;
    String group = state.groupName;
    int end;

    String originTopic = topic;
    int originPartition = partition;
    long originOffset = offset;
    if ((flags & FLAG_HAS_ORIGIN) != 0) {
      if (pos + 14 > size) {
        throw new Refused("marker truncated in the origin");
      }
      originPartition = rd32(v, pos);
      originOffset = rd64(v, pos + 4);
      int originLen = rd16(v, pos + 12);
      if (originPartition < 0 || originOffset < 0) {
        throw new Refused("origin partition and offset must not be negative");
      }
      if (originLen == 0 || originLen > MAX_TOPIC) {
        throw new Refused("origin topic length " + originLen + " is out of range");
      }
      pos += 14;
      end = pos + originLen;
      if (end > size) {
        throw new Refused("marker truncated in the origin topic");
      }
      originTopic = topic(state.originTopic, v, pos, originLen);
      pos = end;
      if (originOffset == offset && originPartition == partition && originTopic.equals(topic)) {
        throw new Refused("origin flag set but the origin equals the message");
      }
    } else if (attempt != 1) {
      throw new Refused("a redelivered copy (attempt > 1) must name its origin");
    }

    long timeoutMs = 0;
    long delayMs = 0;
    boolean policyDelay = false;
    boolean deferred = false;
    String consumer = "";
    String reason = "";
    if (kind != 3 && (flags & DELAY_FLAGS) != 0) {
      throw new Refused("the policy-delay and deferred flags are only valid on DELAY markers");
    }
    int n;
    switch (kind) {
      case 2: // ACK
        break;
      case 1: // START
        pos = startTail(state, v, pos, "START");
        timeoutMs = state.timeoutMs;
        consumer = state.consumerName;
        break;
      case 3: // DELAY
        if (pos + 10 > size) {
          throw new Refused("DELAY marker truncated");
        }
        delayMs = rd64(v, pos);
        if (Long.compareUnsigned(delayMs, MAX_DELAY_MS) > 0) {
          throw new Refused(
              "delay of " + Long.toUnsignedString(delayMs) + " ms is beyond the protocol's limit");
        }
        policyDelay = (flags & FLAG_POLICY_DELAY) != 0;
        deferred = (flags & FLAG_DEFERRED) != 0;
        if (policyDelay && delayMs != 0) {
          throw new Refused("a policy DELAY must carry delay_ms=0");
        }
        if (policyDelay && deferred) {
          throw new Refused("a deferred DELAY cannot leave its delay to the policy");
        }
        n = rd16(v, pos + 8);
        end = pos + 10 + n;
        if (n > MAX_REASON || end > size) {
          throw new Refused("DELAY marker reason too long or truncated");
        }
        reason = text(state, null, v, pos + 10, n, "reason");
        pos = end;
        break;
      case 4: // EXTEND
        pos = extendTail(state, v, pos, "EXTEND");
        timeoutMs = state.timeoutMs;
        break;
      default: // 5: REJECT
        if (pos + 2 > size) {
          throw new Refused("REJECT marker truncated");
        }
        n = rd16(v, pos);
        end = pos + 2 + n;
        if (n > MAX_REASON || end > size) {
          throw new Refused("REJECT marker reason too long or truncated");
        }
        reason = text(state, null, v, pos + 2, n, "reason");
        pos = end;
        break;
    }
    if (pos != size) {
      throw new Refused((size - pos) + " unexpected trailing bytes");
    }
    return RowFactory.create(
        KIND_NAMES[kind],
        group,
        topic,
        partition,
        offset,
        attempt,
        originTopic,
        originPartition,
        originOffset,
        timeoutMs,
        delayMs,
        policyDelay,
        deferred,
        consumer,
        reason,
        null);
  }

  private static List<Row> decodeV2(State state, byte[] v) throws Refused {
    int size = v.length;
    if (size < V2_HEAD_SIZE) {
      throw new Refused("marker of " + size + " bytes is too short");
    }
    int kind = u8(v, 1);
    int flags = u8(v, 2);
    int partition = rd32(v, 3);
    long first = rd64(v, 7);
    long last = rd64(v, 15);
    int topicLen = rd16(v, 23);
    if (kind != 1 && kind != 2 && kind != 4) {
      throw new Refused("unknown range marker kind " + kind);
    }
    if ((flags & ~3) != 0) {
      throw new Refused(String.format("unknown flag bits 0x%02x", flags));
    }
    if (flags == 3) {
      throw new Refused("exceptions cannot be both a bitmap and runs");
    }
    if (partition < 0 || first < 0 || last < 0) {
      throw new Refused("partition and offsets must not be negative");
    }
    if (last < first) {
      throw new Refused("last offset " + last + " is before first offset " + first);
    }
    if (last - first >= MAX_RANGE_WIDTH) { // both >= 0: no overflow (the width itself can)
      throw new Refused(
          "a range of "
              + Long.toUnsignedString(last - first + 1)
              + " offsets is wider than "
              + MAX_RANGE_WIDTH);
    }
    long width = last - first + 1;
    if (topicLen == 0 || topicLen > MAX_TOPIC) {
      throw new Refused("topic length " + topicLen + " is out of range");
    }
    int pos = names(state, v, V2_HEAD_SIZE, topicLen);
    String topic = state.topicName;
    String group = state.groupName;

    long timeoutMs = 0;
    String consumer = "";
    if (kind == 1) { // RANGE_START
      pos = startTail(state, v, pos, "RANGE_START");
      timeoutMs = state.timeoutMs;
      consumer = state.consumerName;
    } else if (kind == 4) { // RANGE_EXTEND
      pos = extendTail(state, v, pos, "RANGE_EXTEND");
      timeoutMs = state.timeoutMs;
    }

    int w = (int) width;
    int nbytes = (w + 7) / 8;
    byte[] excepted = null; // bit i set: offset first + i is an exception
    long setCount = 0;
    if ((flags & 1) != 0) { // bitmap
      if (pos + 4 > size) {
        throw new Refused("exceptions bitmap truncated");
      }
      long length = rdU32(v, pos);
      if (length != nbytes) {
        throw new Refused(
            "exceptions bitmap of "
                + length
                + " bytes for a range of "
                + width
                + " offsets (must be "
                + nbytes
                + ")");
      }
      pos += 4;
      if (pos + nbytes > size) {
        throw new Refused("exceptions bitmap truncated");
      }
      int tailBits = w % 8;
      if (tailBits != 0 && (u8(v, pos + nbytes - 1) >> tailBits) != 0) {
        throw new Refused("exceptions bitmap has bits set beyond the range");
      }
      for (int i = 0; i < nbytes; i++) {
        setCount += Integer.bitCount(u8(v, pos + i));
      }
      if (setCount == 0) {
        throw new Refused("exceptions bitmap is empty (leave the flag unset instead)");
      }
      excepted = Arrays.copyOfRange(v, pos, pos + nbytes);
      pos += nbytes;
    } else if ((flags & 2) != 0) { // runs
      if (pos + 2 > size) {
        throw new Refused("exceptions runs truncated");
      }
      int count = rd16(v, pos);
      pos += 2;
      if (count == 0) {
        throw new Refused("exceptions runs are empty (leave the flag unset instead)");
      }
      if (pos + 8L * count > size) {
        throw new Refused("exceptions runs truncated");
      }
      excepted = new byte[nbytes];
      long previousEnd = -1;
      for (int r = 0; r < count; r++) {
        long start = rdU32(v, pos);
        long length = rdU32(v, pos + 4);
        pos += 8;
        if (length == 0) {
          throw new Refused("an exceptions run has length 0");
        }
        if (start <= previousEnd) {
          throw new Refused("exceptions runs overlap, touch or are out of order");
        }
        if (start + length > width) {
          throw new Refused("an exceptions run reaches beyond the range");
        }
        for (int i = (int) start; i < start + length; i++) {
          excepted[i >> 3] |= (byte) (1 << (i & 7));
        }
        setCount += length;
        previousEnd = start + length;
      }
    }
    if (setCount == width) {
      throw new Refused("the exceptions cover the whole range: the marker covers no offset");
    }
    if (pos != size) {
      throw new Refused((size - pos) + " unexpected trailing bytes");
    }
    String kindName = KIND_NAMES[kind]; // RANGE_START/SETTLE/EXTEND stand for START/ACK/EXTEND
    List<Row> rows = new ArrayList<>((int) (width - setCount));
    for (int i = 0; i < w; i++) {
      if (excepted != null && (excepted[i >> 3] & (1 << (i & 7))) != 0) {
        continue;
      }
      long offset = first + i;
      rows.add(
          RowFactory.create(
              kindName, group, topic, partition, offset, 1, topic, partition, offset, timeoutMs,
              0L, false, false, consumer, "", null));
    }
    return rows;
  }
}
