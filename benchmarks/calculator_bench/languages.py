"""Language slices of the calculator benchmark: seeded, generated text in the languages users send.

The pinned package data (corpus.py) holds almost no prose outside English and a little Chinese, and nothing can be
downloaded, so these slices are *generated*: per language a hand-written list of common words and phrases
(including the words the capped merges of qwen-v3-calculator < 0.2.0 got wrong: являются, элементов, появляется,
المصري, نسبة, أخرى, melanjutkan, いっぱい, 人力资源), from which ``random.Random(seed)`` builds sentences with the
language's punctuation, digits (ASCII and the script's own), dates, percentages and whitespace variety (double
spaces, tabs, CRLF, blank lines, trailing spaces), then paragraphs and documents. Vietnamese and Hebrew documents
sometimes come decomposed (NFD) or with niqqud, as some keyboards and sources send them; Greek sometimes in
capitals. ``mixchat`` is short chat messages (<= 300 characters) mixing two or three of the languages with English
and Chinese, code spans and emoji. Same seed, same documents (no Unicode-table or locale dependence).
"""
from __future__ import annotations

import random
import unicodedata

from .common import LANG_SLICES

# words and short phrases, space-separated ("|" separates multi-word phrases); sep: the word separator of the
# script ("" for Thai and Japanese, whose words are written without spaces)
WORDS = {
    "ru": ("являются|является|элементов|появляется|это|важным|вопросом|и|они|экспертами|в|на|с|по|для|что|как|"
           "который|которые|было|будет|может|можно|нужно|очень|также|только|после|перед|между|система|системы|"
           "данных|данные|компания|компании|пользователь|пользователей|работа|работы|время|года|лет|день|сегодня|"
           "завтра|вчера|город|Москва|Россия|Санкт-Петербург|правительство|развитие|результаты|исследования|"
           "программа|обеспечения|информации|технологии|модель|модели|токенов|запрос|ответ|цена|рублей|процентов|"
           "увеличение|снижение|решение|проблема|вопрос|пожалуйста|спасибо|здравствуйте|например|поэтому|однако|"
           "кроме того|в том числе|по сравнению с|в течение|несмотря на|большое количество|следующих|первый|второй|"
           "новый|старый|хороший|быстро|медленно|всегда|никогда|ещё|уже|очень важно|необходимо|использование|"
           "производства|управления|безопасности|отчёт|финансовый|прибыль|выручка|объём|рынка|клиентов|"
           "сотрудников|проекта|сервер|ошибка|версия|обновление|настройки|файл|пароль|учётная запись"),
    "ar": ("المصري|نسبة|أخرى|في|من|إلى|على|عن|مع|هذا|هذه|التي|الذي|الذين|كان|كانت|يكون|قد|لقد|لم|لن|كل|بعض|"
           "بين|بعد|قبل|حتى|أيضا|أيضاً|جدا|الحكومة|الشركة|الشركات|المستخدم|المستخدمين|البيانات|النظام|التقرير|"
           "السوق|الاقتصاد|الاقتصادي|التنمية|التعليم|الصحة|القاهرة|مصر|السعودية|الرياض|دبي|الإمارات|العربية|"
           "اللغة|العالم|الدولة|المدينة|اليوم|أمس|غدا|السنة|العام|الشهر|مليون|مليار|دولار|جنيه|ريال|بالمئة|"
           "ارتفاع|انخفاض|زيادة|الأرباح|الإيرادات|العملاء|الموظفين|المشروع|الخدمة|الخدمات|من فضلك|شكرا|شكراً|"
           "مرحبا|السلام عليكم|إن شاء الله|بالإضافة إلى|على سبيل المثال|من ناحية أخرى|وفقا ل|خلال|حول|"
           "يجب|يمكن|نريد|أريد|هل|ماذا|كيف|لماذا|متى|أين|الذكاء الاصطناعي|النموذج|الرموز|السعر|الجودة|"
           "المعلومات|التكنولوجيا|الأمن|التحديث|الإصدار|الخطأ|كلمة المرور|الحساب|المُستخدِم|مُحَمَّد|الْعَرَبِيَّة"),
    "th": ("ที่|และ|ของ|ใน|เป็น|การ|ไม่|มี|ได้|ให้|จะ|ว่า|กับ|แต่|หรือ|นี้|นั้น|คน|เรา|คุณ|ผม|ฉัน|เขา|"
           "ประเทศไทย|กรุงเทพมหานคร|รัฐบาล|บริษัท|ลูกค้า|ผู้ใช้|ข้อมูล|ระบบ|รายงาน|การเงิน|กำไร|รายได้|"
           "เพิ่มขึ้น|ลดลง|ร้อยละ|ล้าน|บาท|ปี|เดือน|วันนี้|พรุ่งนี้|เมื่อวาน|ภาษาไทย|ภาษาอังกฤษ|โรงเรียน|"
           "มหาวิทยาลัย|โรงพยาบาล|ความปลอดภัย|เทคโนโลยี|ปัญญาประดิษฐ์|โมเดล|โทเค็น|ราคา|คุณภาพ|บริการ|"
           "สวัสดีครับ|สวัสดีค่ะ|ขอบคุณครับ|ขอบคุณค่ะ|กรุณา|ช่วย|อย่างไร|ทำไม|เมื่อไหร่|ที่ไหน|อะไร|"
           "สำคัญ|มาก|น้อย|ใหม่|เก่า|ดี|เร็ว|ช้า|ทั้งหมด|บางส่วน|ตัวอย่างเช่น|นอกจากนี้|อย่างไรก็ตาม|"
           "เพราะว่า|ดังนั้น|เกี่ยวกับ|ระหว่าง|หลังจาก|ก่อน|ผลิตภัณฑ์|พนักงาน|โครงการ|เซิร์ฟเวอร์|"
           "ข้อผิดพลาด|เวอร์ชัน|รหัสผ่าน|บัญชี|ตั้งค่า|อัปเดต|ไฟล์|น้ำ|ใจ|ความรู้|พัฒนา"),
    "hi": ("है|हैं|था|थे|की|के|का|में|से|को|पर|और|या|लेकिन|यह|वह|ये|वे|एक|नहीं|भी|तो|ही|कि|जो|"
           "भारत|दिल्ली|मुंबई|सरकार|कंपनी|ग्राहक|उपयोगकर्ता|डेटा|प्रणाली|रिपोर्ट|वित्तीय|लाभ|राजस्व|"
           "वृद्धि|गिरावट|प्रतिशत|लाख|करोड़|रुपये|साल|महीने|आज|कल|हिन्दी|हिंदी|अंग्रेज़ी|विद्यालय|"
           "विश्वविद्यालय|अस्पताल|सुरक्षा|प्रौद्योगिकी|कृत्रिम बुद्धिमत्ता|मॉडल|टोकन|कीमत|गुणवत्ता|"
           "सेवा|सेवाएं|नमस्ते|धन्यवाद|कृपया|मदद|कैसे|क्यों|कब|कहाँ|क्या|महत्वपूर्ण|बहुत|कम|नया|"
           "पुराना|अच्छा|तेज़|धीरे|सभी|कुछ|उदाहरण के लिए|इसके अलावा|हालांकि|क्योंकि|इसलिए|के बारे में|"
           "के बीच|के बाद|से पहले|उत्पाद|कर्मचारी|परियोजना|सर्वर|त्रुटि|संस्करण|पासवर्ड|खाता|सेटिंग्स|"
           "अपडेट|फ़ाइल|विकास|शिक्षा|स्वास्थ्य|प्रधानमंत्री|अर्थव्यवस्था|करना|किया|किए|होगा|सकते"),
    "ja": ("いっぱい|です|ます|でした|ません|する|した|して|される|ある|あります|いる|います|なる|なります|"
           "の|は|が|を|に|で|と|も|から|まで|より|へ|や|など|について|として|による|によって|ため|こと|もの|"
           "よう|これ|それ|あれ|この|その|日本|東京|大阪|政府|会社|企業|顧客|ユーザー|データ|システム|報告書|"
           "財務|利益|売上|増加|減少|パーセント|万円|億円|年|月|日|今日|明日|昨日|日本語|英語|学校|大学|病院|"
           "安全|技術|人工知能|モデル|トークン|価格|品質|サービス|こんにちは|ありがとうございます|お願いします|"
           "すみません|どうやって|なぜ|いつ|どこ|何|重要|とても|少し|新しい|古い|良い|速い|遅い|全て|一部|"
           "例えば|さらに|しかし|なぜなら|したがって|製品|社員|プロジェクト|サーバー|エラー|バージョン|"
           "パスワード|アカウント|設定|アップデート|ファイル|開発|教育|健康|経済|人力资源|お腹いっぱい|"
           "ちょっと|やっぱり|ぜひ|確認|対応|検討|予定|結果|問題|質問|回答"),
    "ko": ("있다|있습니다|없다|없습니다|하다|합니다|했습니다|된다|됩니다|이다|입니다|그리고|그러나|하지만|"
           "또는|이|그|저|것|수|등|및|의|에|에서|으로|로|를|을|는|은|가|와|과|도|만|한국|서울|부산|정부|회사|"
           "기업|고객|사용자|데이터|시스템|보고서|재무|이익|매출|증가|감소|퍼센트|만원|억원|년|월|일|오늘|"
           "내일|어제|한국어|영어|학교|대학교|병원|안전|기술|인공지능|모델|토큰|가격|품질|서비스|안녕하세요|"
           "감사합니다|부탁드립니다|죄송합니다|어떻게|왜|언제|어디|무엇|중요한|매우|조금|새로운|오래된|좋은|"
           "빠른|느린|모든|일부|예를 들어|또한|왜냐하면|따라서|제품|직원|프로젝트|서버|오류|버전|비밀번호|"
           "계정|설정|업데이트|파일|개발|교육|건강|경제|대한민국|삼성전자|분석|결과|문제|질문|답변"),
    "id": ("melanjutkan|yang|dan|di|ke|dari|untuk|dengan|pada|dalam|ini|itu|adalah|akan|tidak|bisa|dapat|"
           "sudah|belum|juga|atau|tetapi|karena|sehingga|jika|kami|kita|saya|anda|mereka|Indonesia|Jakarta|"
           "Surabaya|pemerintah|perusahaan|pelanggan|pengguna|data|sistem|laporan|keuangan|laba|pendapatan|"
           "peningkatan|penurunan|persen|juta|miliar|rupiah|tahun|bulan|hari ini|besok|kemarin|bahasa Indonesia|"
           "bahasa Inggris|sekolah|universitas|rumah sakit|keamanan|teknologi|kecerdasan buatan|model|token|"
           "harga|kualitas|layanan|selamat pagi|terima kasih|tolong|silakan|bagaimana|mengapa|kapan|di mana|"
           "apa|penting|sangat|sedikit|baru|lama|baik|cepat|lambat|semua|sebagian|misalnya|selain itu|namun|"
           "oleh karena itu|tentang|antara|setelah|sebelum|produk|karyawan|proyek|server|kesalahan|versi|"
           "kata sandi|akun|pengaturan|pembaruan|berkas|pengembangan|pendidikan|kesehatan|ekonomi|"
           "menggunakan|memberikan|melakukan|menjadi|berdasarkan|pelaksanaan|kebijakan|masyarakat"),
    "el": ("είναι|και|το|η|ο|οι|τα|του|της|των|στο|στη|στην|σε|με|για|από|που|δεν|θα|να|ένα|μια|αυτό|"
           "αυτή|Ελλάδα|Αθήνα|Θεσσαλονίκη|κυβέρνηση|εταιρεία|πελάτες|χρήστης|χρήστες|δεδομένα|σύστημα|"
           "έκθεση|οικονομικά|κέρδη|έσοδα|αύξηση|μείωση|τοις εκατό|εκατομμύρια|ευρώ|χρόνια|μήνα|σήμερα|αύριο|"
           "χθες|ελληνικά|αγγλικά|σχολείο|πανεπιστήμιο|νοσοκομείο|ασφάλεια|τεχνολογία|τεχνητή νοημοσύνη|"
           "μοντέλο|διακριτικά|τιμή|ποιότητα|υπηρεσία|καλημέρα|ευχαριστώ|παρακαλώ|πώς|γιατί|πότε|πού|τι|"
           "σημαντικό|πολύ|λίγο|νέο|παλιό|καλό|γρήγορα|αργά|όλα|μερικά|για παράδειγμα|επιπλέον|ωστόσο|"
           "επειδή|επομένως|σχετικά με|μεταξύ|μετά|πριν|προϊόν|υπάλληλοι|έργο|διακομιστής|σφάλμα|έκδοση|"
           "κωδικός πρόσβασης|λογαριασμός|ρυθμίσεις|ενημέρωση|αρχείο|ανάπτυξη|εκπαίδευση|υγεία|οικονομία|"
           "ϊ|ΰ|προϋπόθεση|Ελληνικός"),
    "vi": ("là|và|của|trong|có|được|cho|không|với|này|đã|những|một|các|người|khi|từ|đến|để|cũng|như|"
           "Việt Nam|Hà Nội|Thành phố Hồ Chí Minh|chính phủ|công ty|khách hàng|người dùng|dữ liệu|hệ thống|"
           "báo cáo|tài chính|lợi nhuận|doanh thu|tăng|giảm|phần trăm|triệu|tỷ|đồng|năm|tháng|hôm nay|"
           "ngày mai|hôm qua|tiếng Việt|tiếng Anh|trường học|đại học|bệnh viện|an toàn|công nghệ|"
           "trí tuệ nhân tạo|mô hình|giá|chất lượng|dịch vụ|xin chào|cảm ơn|làm ơn|vui lòng|như thế nào|"
           "tại sao|khi nào|ở đâu|cái gì|quan trọng|rất|một chút|mới|cũ|tốt|nhanh|chậm|tất cả|một số|"
           "ví dụ|ngoài ra|tuy nhiên|bởi vì|do đó|về|giữa|sau khi|trước khi|sản phẩm|nhân viên|dự án|"
           "máy chủ|lỗi|phiên bản|mật khẩu|tài khoản|cài đặt|cập nhật|tệp|phát triển|giáo dục|sức khỏe|"
           "kinh tế|nghiên cứu|thưởng|Nguyễn|Trần|Lê|Phạm|Hoàng|Huỳnh|Đặng|Bùi|Đỗ|Hồ|Ngô|Dương"),
    "he": ("של|את|על|עם|זה|זו|הוא|היא|הם|לא|כן|גם|אבל|או|כי|אם|כל|יש|אין|היה|תהיה|אני|אנחנו|אתה|"
           "ישראל|ירושלים|תל אביב|חיפה|הממשלה|החברה|לקוחות|משתמש|משתמשים|נתונים|מערכת|דוח|כספים|רווח|"
           "הכנסות|עלייה|ירידה|אחוז|מיליון|מיליארד|שקל|שקלים|שנה|חודש|היום|מחר|אתמול|עברית|אנגלית|"
           "בית ספר|אוניברסיטה|בית חולים|ביטחון|טכנולוגיה|בינה מלאכותית|מודל|טוקנים|מחיר|איכות|שירות|"
           "שלום|תודה|בבקשה|איך|למה|מתי|איפה|מה|חשוב|מאוד|קצת|חדש|ישן|טוב|מהר|לאט|הכול|חלק|לדוגמה|"
           "בנוסף|אולם|מפני ש|לכן|לגבי|בין|אחרי|לפני|מוצר|עובדים|פרויקט|שרת|שגיאה|גרסה|סיסמה|חשבון|"
           "הגדרות|עדכון|קובץ|פיתוח|חינוך|בריאות|כלכלה|שָׁלוֹם|בְּרֵאשִׁית|תּוֹרָה|יִשְׂרָאֵל"),
}
SEP = {"th": "", "ja": ""}
# (sentence end, clause separator, question mark, quote pair)
PUNCT = {
    "ru": (".", ",", "?", ("«", "»")), "ar": (".", "،", "؟", ("«", "»")), "th": (" ", " ", "?", ("“", "”")),
    "hi": ("।", ",", "?", ("“", "”")), "ja": ("。", "、", "？", ("「", "」")), "ko": (".", ",", "?", ("“", "”")),
    "id": (".", ",", "?", ("\"", "\"")), "el": (".", ",", ";", ("«", "»")), "vi": (".", ",", "?", ("“", "”")),
    "he": (".", ",", "?", ("\"", "\"")),
}
# the script's own digits, used for some numbers
DIGITS = {"ar": "٠١٢٣٤٥٦٧٨٩", "th": "๐๑๒๓๔๕๖๗๘๙", "hi": "०१२३४५६७८९", "ja": "０１２３４５６７８９"}
CASED = {"ru", "id", "el", "vi"}
EN = ("the model returns tokens|please check the invoice|thanks|OK|error code|see the docs|deadline is Friday|"
      "LGTM|can you translate this|price per 1M tokens|API key|hello|by the way").split("|")
ZH = ("人力资源|请分析这份财报|谢谢|我们的客户|价格|模型|数据|没问题|今天|明天开会").split("|")
EMOJI = ("😀", "👍", "🙏", "🎉", "🇷🇺", "🇯🇵", "👨‍👩‍👧", "✅", "❤️", "🔥")


def _words(lang: str) -> list[str]:
    return WORDS[lang].split("|")


def _number(lang: str, rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        s = str(rng.randint(0, 100))
    elif r < 0.5:
        s = f"{rng.randint(1, 99)}.{rng.randint(0, 99):02d}%" if lang != "ru" else f"{rng.randint(1, 99)},{rng.randint(0, 9)}%"
    elif r < 0.65:
        s = f"{rng.randint(1990, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    elif r < 0.8:
        s = f"{rng.randint(1, 999):,}".replace(",", " " if lang in ("ru", "el") else ",") + f" {rng.randint(100, 999)}"
    else:
        s = str(rng.randint(1000, 10 ** rng.randint(4, 9)))
    if lang in DIGITS and rng.random() < 0.35:
        s = "".join(DIGITS[lang][int(c)] if c.isdigit() else c for c in s)
    return s


def _sentence(lang: str, rng: random.Random, words: list[str]) -> str:
    end, comma, q, (qo, qc) = PUNCT[lang]
    sep = SEP.get(lang, " ")
    out = []
    for i in range(rng.randint(3, 16)):
        r = rng.random()
        if r < 0.08:
            w = _number(lang, rng)
            w = (" " + w + " ") if not sep else w
        elif r < 0.11:
            w = qo + rng.choice(words) + qc
        elif r < 0.13:
            w = f"({rng.choice(words)})"
        else:
            w = rng.choice(words)
        out.append(w)
        if i and rng.random() < 0.1:
            out[-1] += comma
    s = sep.join(out).strip()
    if lang in CASED and s:
        s = s[0].upper() + s[1:]
    return s + (q if rng.random() < 0.15 else end)


def _space(rng: random.Random) -> str:
    r = rng.random()
    return " " if r < 0.85 else ("  " if r < 0.9 else ("\t" if r < 0.93 else (" \n" if r < 0.97 else "\u00a0")))


def document(lang: str, rng: random.Random, lo: int = 1024, hi: int = 8192) -> str:
    """One document of lo..hi UTF-8 bytes (roughly): paragraphs of sentences, sometimes a list or a table row."""
    words = _words(lang)
    want = rng.randint(lo, hi)
    paras, size = [], 0
    while size < want:
        r = rng.random()
        if r < 0.12:
            p = "\n".join(f"{rng.choice(('-', '*', '1.', '•'))} {_sentence(lang, rng, words)}"
                          for _ in range(rng.randint(2, 5)))
        elif r < 0.18:
            p = "| " + " | ".join(rng.choice(words) for _ in range(3)) + " |\n| " + " | ".join(
                _number(lang, rng) for _ in range(3)) + " |"
        else:
            p = ""
            for _ in range(rng.randint(1, 6)):
                p += _sentence(lang, rng, words) + _space(rng)
            p = p.rstrip(" ") if rng.random() < 0.8 else p
        paras.append(p)
        size += len(p.encode("utf-8"))
    nl = "\r\n" if rng.random() < 0.1 else "\n"
    doc = "".join(p + rng.choice((nl, nl * 2, nl * 2, nl * 3)) for p in paras).rstrip() + nl
    if lang in ("vi", "he", "ko") and rng.random() < 0.2:  # decomposed, as some keyboards and sources send it
        doc = unicodedata.normalize("NFD", doc)
    if lang == "el" and rng.random() < 0.1:
        doc = doc.upper()
    return doc


def mixchat_message(rng: random.Random) -> str:
    """A chat message (<= 300 characters) mixing two or three languages with English, Chinese, code and emoji."""
    langs = rng.sample(list(WORDS), rng.randint(2, 3))
    parts = []
    for lang in langs:
        words = _words(lang)
        parts.append(_sentence(lang, rng, words) if rng.random() < 0.6 else rng.choice(words))
        r = rng.random()
        if r < 0.25:
            parts.append(rng.choice(EN))
        elif r < 0.4:
            parts.append(rng.choice(ZH))
        elif r < 0.5:
            parts.append(f"`{rng.choice(('count_tokens(text)', 'model=qwen3.6', 'x = 42', 'len(s)'))}`")
        if rng.random() < 0.2:
            parts.append(rng.choice(EMOJI))
    msg = rng.choice((" ", " ", "\n", " — ", ": ")).join(parts)
    return msg[:300].rstrip() or "ok"


def language_slices(per_slice_bytes: int, seed: int, n_chat: int) -> dict[str, list[str]]:
    """Every slice of LANG_SLICES: per language documents totalling ~per_slice_bytes; mixchat: n_chat messages."""
    out = {}
    for n, lang in enumerate(LANG_SLICES):
        rng = random.Random(f"{seed}/{lang}")  # str seeds hash with sha512: stable across runs and versions
        if lang == "mixchat":
            out[lang] = [mixchat_message(rng) for _ in range(n_chat)]
            continue
        docs, size = [], 0
        while size < per_slice_bytes:
            d = document(lang, rng, lo=min(1024, per_slice_bytes), hi=min(8192, max(1024, per_slice_bytes // 4)))
            docs.append(d)
            size += len(d.encode("utf-8"))
        out[lang] = docs
    return out
